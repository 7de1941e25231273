"""Decoder layer construction: mixer/MLP selection, RoPE per layer kind, validation."""

import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

from maxtext.configs import load_config
from maxtext.layers.attention import Attention, rope_spec
from maxtext.layers.gated_delta_net import GatedDeltaNet
from maxtext.models.decoder_layer import DecoderLayer


def _with(cfg, **changes):
  d = cfg.as_configdict()
  with d.unlocked():
    for k, v in changes.items():
      d[k] = v
  return ml_collections.FrozenConfigDict(d)


def test_rope_spec_per_layer_kind():
  cfg = load_config(model_name="gemma3-tiny")
  local = rope_spec(cfg, "sliding_attention")
  glob = rope_spec(cfg, "full_attention")
  assert (local.theta, local.rope_type, local.rotary_dim) == (10000.0, "default", 32)
  assert (glob.theta, glob.rope_type, glob.scaling_factor) == (1e6, "linear", 8.0)
  llama = rope_spec(load_config(model_name="llama-tiny"), "full_attention")
  assert (llama.rope_type, llama.original_max_position_embeddings, llama.high_freq_factor) == ("llama3", 64, 4.0)


def test_layer_kinds_select_submodules():
  cfg = load_config(model_name="qwen3-next-tiny")
  gdn_dense = DecoderLayer(cfg, 0, rngs=nnx.Rngs(0))
  attn_moe = DecoderLayer(cfg, 3, rngs=nnx.Rngs(0))
  # The mixer sits under its kind's parameter name (attn / gdn), the other name is absent.
  assert isinstance(gdn_dense.mixer, GatedDeltaNet) and vars(gdn_dense)["gdn"] is gdn_dense.mixer
  assert "attn" not in vars(gdn_dense) and gdn_dense.moe is None and gdn_dense.mlp is not None
  assert (
      isinstance(attn_moe.mixer, Attention) and vars(attn_moe)["attn"] is attn_moe.mixer and "gdn" not in vars(attn_moe)
  )
  assert attn_moe.mixer.gate is not None and attn_moe.mlp is None
  assert gdn_dense.post_attn_norm is None and gdn_dense.post_mlp_norm is None
  gemma = DecoderLayer(load_config(model_name="gemma3-tiny"), 0, rngs=nnx.Rngs(0))
  assert gemma.mixer.sliding_window == 8 and gemma.post_attn_norm is not None and gemma.post_mlp_norm is not None
  assert DecoderLayer(load_config(model_name="gemma3-tiny"), 2, rngs=nnx.Rngs(0)).mixer.sliding_window == 0


def test_layer_validation():
  cfg = load_config(model_name="qwen3-next-tiny")
  with pytest.raises(ValueError, match=r"layer_index must be in \[0, 8\), got 8"):
    DecoderLayer(cfg, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"layer_types\[1\]='rwkv' has no registered mixer \(registered: full_atten"):
    DecoderLayer(_with(cfg, layer_types=("full_attention", "rwkv") + ("full_attention",) * 6), 1, rngs=nnx.Rngs(0))
  gdn = DecoderLayer(cfg, 0, rngs=nnx.Rngs(0))
  kv = (jnp.zeros((1, 2, 2, 32)), jnp.zeros((1, 2, 2, 32)))
  with pytest.raises(ValueError, match=r"a linear_attention \(Gated DeltaNet\) layer cannot take shared K/V"):
    gdn(jnp.zeros((1, 2, 64)), jnp.zeros((1, 2), jnp.int32), kv)
