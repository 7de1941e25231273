"""Tests of the per-layer cache specs and of the slot check that runs before any kernel."""

import hypothesis
import jax.numpy as jnp
import pytest
from hypothesis import strategies as st

from maxtext.configs import load_config
from maxtext.kv_cache import hybrid_cache_utils
from maxtext.kv_cache import kv_cache_spec as kvs


def _qwen_next(**kw):
  base = {
      "decoder_block": "qwen3_next",
      "base_num_decoder_layers": 8,
      "inhomogeneous_layer_cycle_interval": 4,
      "head_dim": 32,
      "gdn_num_key_heads": 2,
      "gdn_num_value_heads": 4,
      "gdn_key_head_dim": 16,
      "gdn_value_head_dim": 24,
  }
  base.update(kw)
  return load_config(**base)


def test_qwen_gdn_spec_matches_the_upstream_layout_figures():
  # The upstream adapter's own figure: (Hv=32, Hk=16, dk=dv=128, K=4) -> ((3, 8192), (32, 128, 128)),
  # (bf16, fp32), 2,146,304 bytes.
  cfg = _qwen_next(
      gdn_num_key_heads=16, gdn_num_value_heads=32, gdn_key_head_dim=128, gdn_value_head_dim=128, dtype="bfloat16"
  )
  spec = kvs.get_kv_cache_specs(cfg)["layer.0"]
  assert isinstance(spec, kvs.RecurrentSpec)
  assert spec.state_shapes == ((3, 8192), (32, 128, 128)) and spec.state_names == ("conv", "recurrent")
  assert spec.state_dtypes == ("bfloat16", "float32")
  assert spec.slot_size_bytes() == 2_146_304
  assert spec.cache_shapes(5) == ((5, 3, 8192), (5, 32, 128, 128))
  assert spec.kind == "linear_attention" and "recurrent (32, 128, 128) float32" in spec.describe()


def test_attention_spec_shape_follows_the_runner_layout():
  # The runner's layout: 8 KV heads, d=128, bf16 -> (N, bs, 8, 2, 128).
  cfg = load_config(base_num_kv_heads=8, base_num_query_heads=8, head_dim=128, dtype="bfloat16", block_size=32)
  spec = kvs.get_kv_cache_specs(cfg)["layer.0"]
  assert spec.cache_shape(10) == (10, 32, 8, 2, 128)
  assert spec.page_size_bytes() == 32 * 8 * 2 * 128 * 2
  assert spec.kind == "full_attention" and spec.sliding_window is None
  assert "Hkv 8, d 128, bfloat16, block 32" in spec.describe()


def test_kv_cache_dtype_and_tensor_parallel_head_padding():
  cfg = load_config(base_num_kv_heads=2, ici_tensor_parallelism=4, kv_cache_dtype="bfloat16")
  spec = kvs.get_kv_cache_specs(cfg)["layer.0"]
  assert spec.num_kv_heads == 4 and spec.dtype == "bfloat16"
  assert kvs.kv_cache_dtype(load_config(dtype="bfloat16")) == "bfloat16"


def test_specs_per_layer_kind_and_kv_sharing():
  cfg = load_config(
      decoder_block="gemma3",
      base_num_decoder_layers=6,
      layer_types=["sliding_attention", "full_attention"] * 3,
      sliding_window_size=8,
      num_kv_shared_layers=2,
  )
  specs = kvs.get_kv_cache_specs(cfg)
  assert sorted(specs) == ["layer.0", "layer.1", "layer.2", "layer.3"]
  assert specs["layer.0"].sliding_window == 8 and specs["layer.1"].sliding_window is None
  assert specs["layer.0"] != specs["layer.1"] and specs["layer.0"] == specs["layer.2"]
  assert kvs.get_shared_kv_cache_layers(cfg) == {"layer.4": "layer.2", "layer.5": "layer.3"}
  assert kvs.get_layer_spec(cfg, 4) == specs["layer.2"]


def test_recurrent_spec_rejects_bad_slot_count():
  spec = kvs.get_kv_cache_specs(_qwen_next())["layer.0"]
  with pytest.raises(ValueError, match=r"num_slots must be an integer >= 1 \(slot 0 is the null slot\), got 0"):
    spec.cache_shapes(0)


def _caches(cfg, num_blocks=4, num_slots=3):
  out = []
  for i in range(cfg.base_num_decoder_layers):
    spec = kvs.get_layer_spec(cfg, i)
    if isinstance(spec, kvs.AttentionSpec):
      out.append(jnp.zeros(spec.cache_shape(num_blocks), spec.dtype))
    else:
      out.append(tuple(jnp.zeros(s, d) for s, d in zip(spec.cache_shapes(num_slots), spec.state_dtypes)))
  return out


def test_matching_caches_pass():
  cfg = _qwen_next()
  kvs.validate_layer_caches(cfg, _caches(cfg))


def test_attention_layer_given_a_recurrent_state_names_layer_kind_and_slot():
  cfg = _qwen_next()
  caches = _caches(cfg)
  caches[3] = caches[0]
  with pytest.raises(
      ValueError,
      match=r"layer.3 is a full_attention layer and needs a paged KV cache \(num_blocks,\) \+ \(16, 4, 1, 128\)"
      r" float32, but kv_caches\[0\] holds a recurrent state \(\(3, 3, 160\) float32,"
      r" \(3, 4, 16, 24\) float32\)",
  ):
    kvs.validate_layer_caches(cfg, caches, layer_indices=(0, 1, 2, 0, 4, 5, 6, 7))


def test_recurrent_layer_given_an_attention_cache():
  cfg = _qwen_next()
  caches = _caches(cfg)
  caches[0] = caches[3]
  with pytest.raises(
      ValueError,
      match=r"layer.0 is a linear_attention layer and needs a recurrent state .* but its"
      r" cache holds an array \(4, 16, 4, 1, 128\) float32",
  ):
    kvs.validate_layer_caches(cfg, caches)


@pytest.mark.parametrize(
    "layer, make, message",
    [
        (3, lambda c: c.astype(jnp.bfloat16), r"layer.3 is a full_attention layer whose cache must be float32"),
        (3, lambda c: c[:, :8], r"needs a paged KV cache .* holds an array \(4, 8, 4, 1, 128\)"),
        (3, lambda c: c[0], r"holds an array \(16, 4, 1, 128\) float32"),
        (0, lambda c: (c[0].astype(jnp.bfloat16), c[1]), r"state arrays must be float32, float32 \(conv, recurrent\)"),
        (0, lambda c: (c[0], c[1].astype(jnp.bfloat16)), r"state arrays must be float32, float32 \(conv, recurrent\)"),
        (0, lambda c: (c[0],), r"holds a recurrent state \(\(3, 3, 160\) float32\)"),
        (0, lambda c: (c[0], "x"), r"holds a tuple of 2 \(an array \(3, 3, 160\) float32, a str\)"),
        (0, lambda c: (c[0], c[1][:2]), r"needs a recurrent state"),
        (0, lambda c: "nothing", r"holds a str"),
    ],
)
def test_wrong_slots_are_rejected(layer, make, message):
  cfg = _qwen_next()
  caches = _caches(cfg)
  caches[layer] = make(caches[layer])
  with pytest.raises(ValueError, match=message):
    kvs.validate_layer_caches(cfg, caches)


def test_bf16_conv_state_is_accepted_for_bf16_models():
  cfg = _qwen_next(dtype="bfloat16")
  kvs.validate_layer_caches(cfg, _caches(cfg))


def test_wrong_number_of_caches():
  cfg = _qwen_next()
  with pytest.raises(ValueError, match=r"expected one cache per layer \(8 layers\), got 7"):
    kvs.validate_layer_caches(cfg, _caches(cfg)[:7])


_QWEN_NEXT = _qwen_next()
_QWEN_CACHES = _caches(_QWEN_NEXT)  # layer order: recurrent at 0-2 and 4-6, attention at 3 and 7


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(order=st.permutations(range(8)), data=st.data())
def test_property_a_slot_of_the_other_kind_is_rejected_naming_layer_and_slot(order, data):
  # Physical list in a random order, the runner's map resolved, then one layer pointed at a slot of the other kind.
  physical = [_QWEN_CACHES[layer] for layer in order]
  slot_of = {layer: order.index(layer) for layer in range(8)}
  pairs = tuple((f"layer.{layer}", slot_of[layer]) for layer in range(8))
  indices = hybrid_cache_utils.resolve_layer_kv_cache_indices(pairs, 8, 8)
  kvs.validate_layer_caches(_QWEN_NEXT, hybrid_cache_utils.gather_layer_kv_caches(physical, indices), indices)
  victim = data.draw(st.sampled_from(range(8)))
  is_attention = _QWEN_NEXT.layer_types[victim] == "full_attention"
  other_kind = [layer for layer in range(8) if (_QWEN_NEXT.layer_types[layer] == "full_attention") != is_attention]
  wrong = slot_of[data.draw(st.sampled_from(other_kind))]
  corrupted = tuple((name, wrong if name == f"layer.{victim}" else slot) for name, slot in pairs)
  indices = hybrid_cache_utils.resolve_layer_kv_cache_indices(corrupted, 8, 8)
  if is_attention:
    needs, holds = "full_attention layer and needs a paged KV cache", "a recurrent state"
  else:
    needs, holds = "linear_attention layer and needs a recurrent state", "an array"
  match = rf"layer.{victim} is a {needs} .* but kv_caches\[{wrong}\] holds {holds}"
  with pytest.raises(ValueError, match=match):
    kvs.validate_layer_caches(_QWEN_NEXT, hybrid_cache_utils.gather_layer_kv_caches(physical, indices), indices)
