"""The per-layer specs the model states for a runner that asks (docs/tpu-inference-kv-cache-spec.patch).

Expected values are written out from the tiny configs (configs/models/*.yml), not computed by the code under test.
"""

import jax
import pytest

from maxtext.configs import load_config
from maxtext.integration.vllm.adapter import MaxTextForCausalLM
from maxtext.kv_cache import kv_cache_spec_data as spec_data_lib
from maxtext.kv_cache.kv_cache_spec import get_layer_spec
from maxtext.kv_cache.kv_cache_spec_data import kv_cache_spec_data
from maxtext.kv_cache.cache_spec import RecurrentSpec


def _attention(kind, heads=2, head_size=32, window=None, dtype="bfloat16"):
  return {"kind": kind, "num_kv_heads": heads, "head_size": head_size, "sliding_window": window, "dtype": dtype}


def _gdn(conv, recurrent, conv_dtype="bfloat16"):
  return {"kind": "mamba", "mamba_type": "GDN_ATTN", "shapes": (conv, recurrent), "dtypes": (conv_dtype, "float32")}


def test_qwen3_5_states_gdn_layers_as_mamba_and_every_fourth_as_full_attention():
  cfg = load_config(model_name="qwen3.5-tiny", dtype="bfloat16")
  # conv_dim = 2 * nk * dk + nv * dv = 2 * 2 * 16 + 4 * 24 = 160; K = 4 keeps 3 rows.
  gdn = _gdn((3, 160), (4, 16, 24))
  full = _attention("full_attention")
  assert kv_cache_spec_data(cfg) == {
      "layers": {f"layer.{i}": full if i % 4 == 3 else gdn for i in range(8)},
      "shared_kv_cache_layers": {},
  }


def test_gemma3_states_sliding_windows():
  cfg = load_config(model_name="gemma3-tiny", dtype="float32")
  data = kv_cache_spec_data(cfg)
  sliding = _attention("sliding_window", window=8, dtype="float32")
  full = _attention("full_attention", dtype="float32")
  assert data["layers"] == {f"layer.{i}": full if i % 3 == 2 else sliding for i in range(6)}
  assert not data["shared_kv_cache_layers"]


def test_kv_sharing_layers_have_no_spec_and_name_their_source():
  cfg = load_config(model_name="kvshare-tiny", dtype="float32")
  data = kv_cache_spec_data(cfg)
  # Layers [s, s, f, s, s, f]; the last two reuse layers 3 (sliding) and 2 (full).
  assert sorted(data["layers"]) == ["layer.0", "layer.1", "layer.2", "layer.3"]
  assert data["shared_kv_cache_layers"] == {"layer.4": "layer.3", "layer.5": "layer.2"}
  assert data["layers"]["layer.3"]["kind"] == "sliding_window"
  assert data["layers"]["layer.2"]["kind"] == "full_attention"


@pytest.mark.parametrize("tp", [1, 4])
def test_kv_heads_are_the_models_own_whatever_the_tensor_parallel_size(tp):
  # The runner pads KV heads to its own TP size; the model reports its 2 real heads.
  cfg = load_config(model_name="qwen3-tiny", ici_tensor_parallelism=tp)
  assert {layer["num_kv_heads"] for layer in kv_cache_spec_data(cfg)["layers"].values()} == {2}


def test_the_model_class_exposes_its_spec_data():
  cfg = load_config(model_name="qwen3.5-tiny", block_size=4)
  model = MaxTextForCausalLM.from_config(cfg, jax.random.key(0), None)
  assert model.get_kv_cache_spec_data() == kv_cache_spec_data(cfg)
  assert model.get_kv_cache_spec_data()["layers"]["layer.0"]["kind"] == "mamba"


def test_a_recurrent_kind_without_a_vllm_mamba_backend_is_refused():
  spec = RecurrentSpec(layer_type="mamba2", state_names=("ssm",), state_shapes=((4, 8),), state_dtypes=("float32",))
  cfg = load_config(model_name="qwen3.5-tiny")
  with pytest.raises(NotImplementedError, match="layer.2 is a mamba2 layer, which has no vLLM mamba backend"):
    spec_data_lib._layer_data(cfg, "layer.2", spec)  # pylint: disable=protected-access


@pytest.mark.parametrize("name", ["granite4-tiny", "bamba-tiny"])
def test_mamba2_layers_are_stated_as_vllm_mamba2_states(name):
  cfg = load_config(model_name=name)
  data = kv_cache_spec_data(cfg)
  mamba = [i for i, kind in enumerate(cfg.layer_types) if kind == "mamba"]
  assert mamba
  for i in mamba:
    spec = get_layer_spec(cfg, i)
    assert data["layers"][f"layer.{i}"] == {
        "kind": "mamba",
        "mamba_type": "MAMBA2",
        "shapes": tuple(tuple(s) for s in spec.state_shapes),
        "dtypes": tuple(spec.state_dtypes),
    }
