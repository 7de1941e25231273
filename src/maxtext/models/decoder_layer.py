"""One decoder layer of the hybrid stack: norm -> mixer (the layer kind's) -> norm -> MLP or MoE."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.configs import families
from maxtext.configs.families.family import FFN_FEED_FORWARD, FFN_GRANITE, FFN_MLP
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.kernels.backend import KernelBackend, default_backend
from maxtext.layers.declarations import ParamDecl, StoredTensors, nest
from maxtext.layers.mixer import KV, Mixer, layer_mixer_class
from maxtext.layers.mlp import MLP
from maxtext.layers.moe import MoE
from maxtext.layers.normalizations import RMSNorm


def _mlp_or_moe(cfg: ml_collections.FrozenConfigDict, i: int, stored: StoredTensors) -> list[ParamDecl]:
  """`mlp.`: the routed experts on the config's MoE layers, the dense MLP elsewhere."""
  if cfg.moe_layers[i]:
    return nest(MoE.declare(cfg, i, stored.under("mlp.")), "moe.", "mlp.")
  return nest(MLP.declare(cfg.base_emb_dim, cfg.base_mlp_dim, use_bias=cfg.mlp_bias), "mlp.", "mlp.")


def _feed_forward(cfg: ml_collections.FrozenConfigDict, i: int, stored: StoredTensors) -> list[ParamDecl]:
  """`feed_forward.`: a dense MLP on every layer (Bamba)."""
  del i, stored  # one layout
  return nest(MLP.declare(cfg.base_emb_dim, cfg.base_mlp_dim, use_bias=cfg.mlp_bias), "mlp.", "feed_forward.")


def _granite_shared_mlp(cfg: ml_collections.FrozenConfigDict, i: int, stored: StoredTensors) -> list[ParamDecl]:
  """Granite 4.0: the fused `shared_mlp.`, beside the `block_sparse_moe.` experts on MoE layers."""
  if cfg.moe_layers[i]:
    return nest(MoE.declare_granite(cfg, stored), "moe.")
  return nest(MLP.declare_fused(cfg.base_emb_dim, cfg.base_mlp_dim), "mlp.", "shared_mlp.")


# The feed-forward layouts a family names in `TensorLayout.ffn`: (cfg, layer index, the layer's stored tensors) ->
# the declarations of its MLP or MoE.
FEED_FORWARD_LAYOUTS: dict[str, Callable[[ml_collections.FrozenConfigDict, int, StoredTensors], list[ParamDecl]]] = {
    FFN_MLP: _mlp_or_moe,
    FFN_FEED_FORWARD: _feed_forward,
    FFN_GRANITE: _granite_shared_mlp,
}


class DecoderLayer(nnx.Module):
  """Decoder layer `layers.{i}` with `input_norm`, the mixer of its layer kind (held as the mixer's `param_name`,
  e.g. `attn`, `gdn` or `mamba`), `pre_mlp_norm`, `mlp` | `moe`, and for sandwich-norm families (Gemma3) `post_attn_norm`
  and `post_mlp_norm`."""

  def __init__(self, cfg: ml_collections.FrozenConfigDict, layer_index: int, *, rngs: nnx.Rngs):
    if not 0 <= layer_index < len(cfg.layer_types):
      raise ValueError(f"layer_index must be in [0, {len(cfg.layer_types)}), got {layer_index}")
    self.layer_index = layer_index
    self.layer_type = cfg.layer_types[layer_index]
    self.kv_source = cfg.kv_shared_source[layer_index]
    self.residual_multiplier = float(cfg.residual_multiplier)
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    d = cfg.base_emb_dim
    norm_kw = {
        "eps": cfg.normalization_layer_epsilon,
        "zero_centered": cfg.use_zero_centered_norm,
        "weight_dtype": weight_dtype,
        "rngs": rngs,
    }
    kw = {"dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.input_norm = RMSNorm(d, **norm_kw)
    mixer_class = layer_mixer_class(cfg, layer_index)
    self.mixer_name = mixer_class.param_name
    setattr(self, self.mixer_name, mixer_class.from_config(cfg, layer_index, rngs=rngs))
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
          gate_shared=cfg.shared_expert_gate,
          normalize_top_k=cfg.norm_topk_prob,
          activation=activation,
          use_bias=cfg.use_moe_bias,
          swiglu_alpha=cfg.swiglu_alpha,
          swiglu_limit=cfg.swiglu_limit if cfg.use_clamped_swiglu else 0.0,
          **kw,
      )
    else:
      self.moe = None
      self.mlp = MLP(d, cfg.base_mlp_dim, activation=activation, use_bias=cfg.mlp_bias, **kw)

  @classmethod
  def declare(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: StoredTensors = StoredTensors()
  ) -> list[ParamDecl]:
    """The parameters of layer `layer_index`, Hugging Face names relative to its `model.layers.{i}.`: the norms
    (the pre-MLP one as the family's layout names it), the mixer's (`Mixer.declare`) and the feed-forward's in the
    family's layout (`FEED_FORWARD_LAYOUTS`)."""
    d = cfg.base_emb_dim
    layout = families.get_family(cfg.decoder_block).tensors
    decls = nest(RMSNorm.declare(d, "input_layernorm.weight"), "input_norm.")
    if cfg.use_sandwich_norm:
      decls += nest(RMSNorm.declare(d, "post_attention_layernorm.weight"), "post_attn_norm.")
      decls += nest(RMSNorm.declare(d, "pre_feedforward_layernorm.weight"), "pre_mlp_norm.")
      decls += nest(RMSNorm.declare(d, "post_feedforward_layernorm.weight"), "post_mlp_norm.")
    else:
      decls += nest(RMSNorm.declare(d, layout.pre_mlp_norm + ".weight"), "pre_mlp_norm.")
    mixer_class = layer_mixer_class(cfg, layer_index)
    decls += nest(mixer_class.declare(cfg, layer_index, stored), mixer_class.param_name + ".")
    return decls + FEED_FORWARD_LAYOUTS[layout.ffn](cfg, layer_index, stored)

  @property
  def mixer(self) -> Mixer:
    """This layer's token mixer."""
    return getattr(self, self.mixer_name)

  def feed_forward(self, x: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Dense MLP or MoE on `backend` (default: the reference backend): `[..., D] -> [..., D]`."""
    return self.mlp(x, backend) if self.mlp is not None else self.moe(x, backend)

  def _scaled(self, y: jax.Array) -> jax.Array:
    """A branch output times `residual_multiplier` (Granite 4.0), before it joins the residual stream."""
    return y if self.residual_multiplier == 1.0 else y * jnp.asarray(self.residual_multiplier, y.dtype)

  def residual_mixer(self, x: jax.Array, mixed: jax.Array) -> jax.Array:
    """Adds the mixer output (after the sandwich post-norm if any, times `residual_multiplier`) to the residual."""
    if self.post_attn_norm is not None:
      mixed = self.post_attn_norm(mixed)
    return x + self._scaled(mixed)

  def residual_feed_forward(self, x: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """`x + residual_multiplier * [post_mlp_norm](ffn(pre_mlp_norm(x)))`."""
    y = self.feed_forward(self.pre_mlp_norm(x), backend)
    if self.post_mlp_norm is not None:
      y = self.post_mlp_norm(y)
    return x + self._scaled(y)

  def paged(
      self,
      x: jax.Array,
      positions: jax.Array,
      cache: Any,
      md: AttentionMetadata,
      backend: KernelBackend | None = None,
  ) -> tuple[jax.Array, Any]:
    """Runner path over a flat ragged batch, reusing the dense path's projections, norms and MLP.

    Args:
      x: `[T, D]` residual stream.
      positions: `[T]`.
      cache: this layer's paged KV cache, or its `(conv_state, recurrent_state)` pair; a KV-shared layer gets the
        cache its source layer returned in this step.
      md: this layer's attention metadata.
      backend: the kernel backend every runner op goes through (default: the reference backend).

    Returns:
      new residual `[T, D]` and the layer's cache after the step.
    """
    backend = default_backend() if backend is None else backend
    mixed, cache = self.mixer.paged(self.input_norm(x), positions, cache, md, backend)
    return self.residual_feed_forward(self.residual_mixer(x, mixed), backend), cache

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, positions: jax.Array, shared_kv: KV | None = None, *, gdn_chunked: bool = True
  ) -> tuple[jax.Array, KV | None]:
    """Dense full-sequence layer (`Transformer.__call__`, the tests' reference; the runners call `paged`).

    Args:
      x: `[B, T, D]` residual stream.
      positions: `[B, T]`.
      shared_kv: the source layer's `(k, v)` for KV-shared layers, else None.
      gdn_chunked: the full-sequence form of recurrent mixers (chunked, or token by token; they agree to fp32
        rounding).

    Returns:
      new residual `[B, T, D]` and this layer's shareable `(k, v)` (None for recurrent layers).
    """
    mixed, kv = self.mixer(self.input_norm(x), positions, shared_kv, chunked=gdn_chunked)
    return self.residual_feed_forward(self.residual_mixer(x, mixed)), kv
