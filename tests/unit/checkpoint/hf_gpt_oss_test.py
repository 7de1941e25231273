"""gpt-oss checkpoints: the config mapping, that every gpt-oss trait is needed for parity, the bundled tiny config.

Parity itself (logits and greedy tokens against transformers' GptOssForCausalLM) is a case of
`hf_test.test_logits_and_greedy_tokens_match_transformers`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import hf
from maxtext.checkpoint.hf_config import hf_config_to_overrides, read_hf_config
from maxtext.configs import load_config
from maxtext.models import Transformer, assign_params

_TOKENS = 40  # longer than the sliding window (8) and yarn's original context (32)


def _hf_logits(torch_model, tokens: np.ndarray) -> np.ndarray:
  import torch  # pylint: disable=import-outside-toplevel  # optional test dependency (hf marker)

  with torch.no_grad():
    return torch_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module", name="gpt_oss")
def _gpt_oss(hf_checkpoint):
  """(folder, params, transformers' logits, tokens) of the tiny gpt-oss checkpoint."""
  folder, torch_model = hf_checkpoint("gpt_oss")
  tokens = np.random.default_rng(4).integers(0, 512, size=(1, _TOKENS), dtype=np.int32)
  cfg = hf.load_hf_config(folder)
  return folder, hf.load_hf_params(folder, cfg), _hf_logits(torch_model, tokens), tokens


def _logits(params: dict, tokens: np.ndarray, **overrides) -> np.ndarray:
  """Our logits of `tokens [1, T]` with the checkpoint's parameters under the config `overrides`."""
  model = Transformer(load_config(**overrides), rngs=nnx.Rngs(0))
  assign_params(model, params)
  return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


@pytest.mark.hf
def test_config_json_maps_to_every_gpt_oss_key(gpt_oss):
  folder, _, _, _ = gpt_oss
  cfg = hf.load_hf_config(folder)
  assert cfg.decoder_block == "gpt_oss"
  assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window_size == 8
  assert cfg.inhomogeneous_layer_cycle_interval == 2 and cfg.moe_layers == (True,) * 4
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim, cfg.norm_topk_prob) == (4, 2, 48, True)
  assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.attention_bias, cfg.logits_via_embedding) == (1.702, 1.5, True, False)
  rope = (cfg.rope_type, cfg.rope_scaling_factor, cfg.rope_original_max_position_embeddings, cfg.rope_truncate)
  assert rope == ("yarn", 8.0, 32, False)
  assert (cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_max_timescale, cfg.rope_attention_factor) == (
      32.0,
      1.0,
      150000.0,
      0.0,
  )


@pytest.mark.hf
def test_bundled_tiny_config_is_the_same_model_as_the_tiny_checkpoint(gpt_oss):
  folder, params, ref, tokens = gpt_oss
  from_hf = hf.load_hf_config(folder)
  bundled = load_config(model_name="gpt-oss-tiny")
  keys = [k for k in hf_config_to_overrides(read_hf_config(folder)) if k != "base_mlp_dim"]
  assert {k: bundled[k] for k in keys} == {k: from_hf[k] for k in keys}
  np.testing.assert_allclose(_logits(params, tokens, model_name="gpt-oss-tiny"), ref, atol=1e-4, rtol=0)


@pytest.mark.hf
@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"swiglu_limit": 100.0}, id="no-clamp"),
        pytest.param({"swiglu_alpha": 1.0}, id="sigmoid-gain-1"),
        pytest.param({"rope_truncate": True}, id="yarn-truncated-ramp"),
        pytest.param({"rope_attention_factor": 1.0}, id="yarn-without-attention-factor"),
        pytest.param({"rope_type": "default"}, id="no-yarn"),
        pytest.param({"sliding_window_size": 64}, id="no-window"),
    ],
)
def test_each_gpt_oss_trait_is_needed_for_parity(gpt_oss, change):
  """The parity test can fail: dropping any one trait moves the logits far beyond its 1e-4 tolerance."""
  folder, params, ref, tokens = gpt_oss
  cfg = hf.load_hf_config(folder)
  overrides = {k: cfg[k] for k in hf_config_to_overrides(read_hf_config(folder))}
  overrides.update(change)
  assert float(np.abs(_logits(params, tokens, **overrides) - ref).max()) > 1e-2


@pytest.mark.hf
def test_sinks_and_biases_are_needed_for_parity(gpt_oss):
  folder, params, ref, tokens = gpt_oss
  overrides = dict(hf_config_to_overrides(read_hf_config(folder)))
  for suffix in ("attn.sinks", "moe.router.bias", "moe.gate_bias", "moe.up_bias", "moe.down_bias", "attn.o.bias"):
    changed = {k: (np.zeros_like(v) if k.endswith(suffix) else v) for k, v in params.items()}
    assert float(np.abs(_logits(changed, tokens, **overrides) - ref).max()) > 1e-2, suffix


@pytest.mark.hf
def test_gate_up_columns_are_interleaved(gpt_oss):
  folder, params, _, _ = gpt_oss
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel  # hf extra

  raw = load_file(str(folder / "model.safetensors"))["model.layers.1.mlp.experts.gate_up_proj"]  # [E, D, 2F]
  np.testing.assert_array_equal(params["layers.1.moe.gate"], raw[..., 0::2])
  np.testing.assert_array_equal(params["layers.1.moe.up"], raw[..., 1::2])


@pytest.mark.hf
def test_mxfp4_experts_are_rejected_by_name(gpt_oss, tmp_path, rewrite_checkpoint):
  folder = gpt_oss[0]
  bad = tmp_path / "mxfp4"
  blocks = {"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros((4, 96, 2, 16), np.uint8)}
  rewrite_checkpoint(folder, bad, drop=("model.layers.0.mlp.experts.gate_up_proj",), add=blocks)
  with pytest.raises(NotImplementedError, match=r"layer 0: MXFP4-quantised gpt-oss experts"):
    list(hf.iter_hf_params(bad, hf.load_hf_config(bad)))


def test_config_json_defaults_are_transformers_defaults():
  overrides = hf_config_to_overrides({"model_type": "gpt_oss", "num_hidden_layers": 4})
  assert overrides["layer_types"] == ["sliding_attention", "full_attention"] * 2
  assert (overrides["base_emb_dim"], overrides["num_experts"], overrides["sliding_window_size"]) == (2880, 128, 128)
  assert (overrides["rope_type"], overrides["rope_scaling_factor"], overrides["rope_truncate"]) == ("yarn", 32.0, False)
  assert overrides["rope_original_max_position_embeddings"] == 4096 and overrides["rope_max_timescale"] == 150000.0


def test_yarn_with_mscale_is_rejected():
  rope = {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 4096}
  with pytest.raises(NotImplementedError, match=r"yarn rope scaling with mscale \(rope_parameters\) is not supported"):
    hf_config_to_overrides({"model_type": "gpt_oss", "rope_parameters": rope})
