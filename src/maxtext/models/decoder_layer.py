"""One decoder layer of the hybrid stack: norm -> mixer (attention or Gated DeltaNet) -> norm -> MLP or MoE."""

import logging
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.configs.derived import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.layers.attention import Attention
from maxtext.layers.gated_delta_net import GatedDeltaNet
from maxtext.layers.mlp import MLP
from maxtext.layers.moe import MoE
from maxtext.layers.normalizations import RMSNorm
from maxtext.layers.rotary import RopeSpec

logger = logging.getLogger(__name__)


KV = tuple[jax.Array, jax.Array]


def rope_spec(cfg: ml_collections.FrozenConfigDict, layer_type: str) -> RopeSpec:
  """RoPE of an attention layer: global layers use `rope_max_timescale` and `rope_type` scaling; sliding layers
  use `local_rope_max_timescale` without scaling."""
  if layer_type == SLIDING_ATTENTION:
    return RopeSpec(rotary_dim=cfg.rotary_dim, theta=cfg.local_rope_max_timescale)
  return RopeSpec(
      rotary_dim=cfg.rotary_dim,
      theta=cfg.rope_max_timescale,
      rope_type=cfg.rope_type,
      scaling_factor=cfg.rope_scaling_factor,
      low_freq_factor=cfg.rope_low_freq_factor,
      high_freq_factor=cfg.rope_high_freq_factor,
      original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
  )


class DecoderLayer(nnx.Module):
  """Decoder layer `layers.{i}` with `input_norm`, `attn` | `gdn`, `pre_mlp_norm`, `mlp` | `moe`, and for
  sandwich-norm families (Gemma3) `post_attn_norm` and `post_mlp_norm`."""

  def __init__(self, cfg: ml_collections.FrozenConfigDict, layer_index: int, *, rngs: nnx.Rngs):
    if not 0 <= layer_index < len(cfg.layer_types):
      raise ValueError(f"layer_index must be in [0, {len(cfg.layer_types)}), got {layer_index}")
    self.layer_index = layer_index
    self.layer_type = cfg.layer_types[layer_index]
    self.kv_source = cfg.kv_shared_source[layer_index]
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    d = cfg.base_emb_dim
    norm_kw = {
        "eps": cfg.normalization_layer_epsilon,
        "zero_centered": cfg.use_zero_centered_norm,
        "weight_dtype": weight_dtype,
    }
    kw = {"dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.input_norm = RMSNorm(d, **norm_kw)
    if self.layer_type == LINEAR_ATTENTION:
      self.attn = None
      self.gdn = GatedDeltaNet(
          emb_dim=d,
          num_key_heads=cfg.gdn_num_key_heads,
          num_value_heads=cfg.gdn_num_value_heads,
          key_head_dim=cfg.gdn_key_head_dim,
          value_head_dim=cfg.gdn_value_head_dim,
          conv_kernel_dim=cfg.gdn_conv_kernel_dim,
          chunk_size=cfg.gdn_chunk_size,
          norm_eps=cfg.normalization_layer_epsilon,
          **kw,
      )
    elif self.layer_type in (FULL_ATTENTION, SLIDING_ATTENTION):
      self.gdn = None
      self.attn = Attention(
          emb_dim=d,
          num_query_heads=cfg.base_num_query_heads,
          num_kv_heads=cfg.base_num_kv_heads,
          head_dim=cfg.head_dim,
          attention_scale=cfg.attention_scale,
          rope=rope_spec(cfg, self.layer_type),
          sliding_window=cfg.sliding_window_size if self.layer_type == SLIDING_ATTENTION else 0,
          soft_cap=cfg.attn_logits_soft_cap,
          use_bias=cfg.attention_bias,
          use_qk_norm=cfg.use_qk_norm,
          zero_centered_norm=cfg.use_zero_centered_norm,
          norm_eps=cfg.normalization_layer_epsilon,
          use_output_gate=cfg.use_attention_output_gate,
          is_kv_shared=self.kv_source >= 0,
          **kw,
      )
    else:
      raise ValueError(f"layer_types[{layer_index}]={self.layer_type!r} is not a supported layer type")
    self.post_attn_norm = RMSNorm(d, **norm_kw) if cfg.use_sandwich_norm else None
    self.pre_mlp_norm = RMSNorm(d, **norm_kw)
    self.post_mlp_norm = RMSNorm(d, **norm_kw) if cfg.use_sandwich_norm else None
    activation = cfg.mlp_activations[0]
    if cfg.moe_layers[layer_index]:
      self.mlp = None
      self.moe = MoE(
          d,
          cfg.num_experts,
          cfg.num_experts_per_tok,
          cfg.base_moe_mlp_dim,
          shared_mlp_dim=cfg.shared_expert_mlp_dim,
          normalize_top_k=cfg.norm_topk_prob,
          activation=activation,
          **kw,
      )
    else:
      self.moe = None
      self.mlp = MLP(d, cfg.base_mlp_dim, activation=activation, use_bias=cfg.mlp_bias, **kw)

  def mixer(
      self, x: jax.Array, positions: jax.Array, shared_kv: KV | None = None, *, gdn_chunked: bool = True
  ) -> tuple[jax.Array, KV | None]:
    """Token mixer on normalised input: `[B, T, D] -> [B, T, D]`, plus the attention layer's `(k, v)`.

    `gdn_chunked` picks the Gated DeltaNet form: chunked (default) or the per-token recurrence.
    """
    if self.gdn is not None:
      if shared_kv is not None:
        raise ValueError(f"layer {self.layer_index} is linear_attention and cannot take shared K/V")
      return self.gdn(x, chunked=gdn_chunked), None
    return self.attn(x, positions, shared_kv)

  def feed_forward(self, x: jax.Array) -> jax.Array:
    """Dense MLP or MoE: `[..., D] -> [..., D]`."""
    return self.mlp(x) if self.mlp is not None else self.moe(x)

  def residual_mixer(self, x: jax.Array, mixed: jax.Array) -> jax.Array:
    """Adds the mixer output (after the sandwich post-norm if any) to the residual stream."""
    if self.post_attn_norm is not None:
      mixed = self.post_attn_norm(mixed)
    return x + mixed

  def residual_feed_forward(self, x: jax.Array) -> jax.Array:
    """`x + [post_mlp_norm](ffn(pre_mlp_norm(x)))`."""
    y = self.feed_forward(self.pre_mlp_norm(x))
    if self.post_mlp_norm is not None:
      y = self.post_mlp_norm(y)
    return x + y

  def paged(self, x: jax.Array, positions: jax.Array, cache: Any, md: AttentionMetadata) -> tuple[jax.Array, Any]:
    """Runner path over a flat ragged batch, reusing the dense path's projections, norms and MLP.

    Args:
      x: `[T, D]` residual stream.
      positions: `[T]`.
      cache: this layer's paged KV cache, or its `(conv_state, recurrent_state)` pair; a KV-shared layer gets the
        cache its source layer returned in this step.
      md: this layer's attention metadata.

    Returns:
      new residual `[T, D]` and the layer's cache after the step.
    """
    h = self.input_norm(x)
    if self.gdn is not None:
      mixed, cache = self.gdn.paged(h, cache, md)
    else:
      mixed, cache = self.attn.paged(h, positions, cache, md)
    return self.residual_feed_forward(self.residual_mixer(x, mixed)), cache

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, positions: jax.Array, shared_kv: KV | None = None, *, gdn_chunked: bool = True
  ) -> tuple[jax.Array, KV | None]:
    """Dense full-sequence layer.

    Args:
      x: `[B, T, D]` residual stream.
      positions: `[B, T]`.
      shared_kv: the source layer's `(k, v)` for KV-shared layers, else None.
      gdn_chunked: Gated DeltaNet form (chunked, or the per-token recurrence; they agree to fp32 rounding).

    Returns:
      new residual `[B, T, D]` and this layer's `(k, v)` (None for Gated DeltaNet layers).
    """
    mixed, kv = self.mixer(self.input_norm(x), positions, shared_kv, gdn_chunked=gdn_chunked)
    return self.residual_feed_forward(self.residual_mixer(x, mixed)), kv
