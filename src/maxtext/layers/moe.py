"""Mixture of experts: softmax top-k router, stacked SwiGLU experts, optional shared expert (sigmoid-gated or plain).

gpt-oss adds a router bias, per-expert biases and the clamped SwiGLU (`clamped_swiglu`); its softmax over the top-k
logits equals the softmax over all experts renormalised over the top k (`normalize=True`).
The routed-expert computation itself is the kernel backend's `moe_experts` op.
"""

import functools
from collections.abc import Container
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from maxtext.kernels.backend import EXPERT_METHODS, KernelBackend, default_backend
from maxtext.layers.declarations import ParamDecl, nest
from maxtext.layers.initializers import draw_key, fan_in_uniform, uniform
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.mlp import MLP, clamped_swiglu, get_activation
from maxtext.layers.tensor_sources import Reader, Shape, Source, cast, fused_down, fused_gate_up, linear, same, stacked

# Logical axes of the stacked experts: [E, D, Fe] (gate, up) and [E, Fe, D] (down).
_EXPERTS_IN = ("exp", "embed", "mlp")
_EXPERTS_OUT = ("exp", "mlp", "embed")


def interleaved_gate_up(tensor: str, shape: Shape) -> Source:
  """gpt-oss's gate_up_proj `[..., 2*Fe]` (or its bias), gate at even and up at odd positions of the last axis ->
  gate (part 0), up (part 1) `[..., Fe]`."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    return cast(w[..., 0::2], dt), cast(w[..., 1::2], dt)

  half = shape[:-1] + (shape[-1] // 2,)
  return Source((tensor,), (shape,), (half, half), convert)


def route(router_logits: jax.Array, *, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
  """Softmax router in float32 followed by top-k selection.

  Args:
    router_logits: `[T, E]`.
    top_k: experts per token.
    normalize: renormalise the selected probabilities to sum to one.

  Returns:
    weights `[T, k]` float32 and expert indices `[T, k]` int32, in descending weight order.
  """
  num_experts = router_logits.shape[-1]
  if not 0 < top_k <= num_experts:
    raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, indices = jax.lax.top_k(probs, top_k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, indices.astype(jnp.int32)


class MoE(nnx.Module):
  """Routed experts plus an optional shared expert.

  Parameters: `router.kernel [D, E]`, `gate [E, D, Fe]`, `up [E, D, Fe]`, `down [E, Fe, D]`, and when
  `shared_mlp_dim > 0`: `shared.{gate,up,down}.kernel` and, with `gate_shared` (Qwen3-Next), `shared_gate.kernel
  [D, 1]` (without it, Granite 4.0, the shared expert's output is added as it is); with `use_bias`:
  `router.bias [E]`, `gate_bias`, `up_bias [E, Fe]`, `down_bias [E, D]`. `swiglu_limit > 0` selects the clamped
  SwiGLU (`swiglu_alpha`, `swiglu_limit`) instead of `activation`.
  """

  def __init__(
      self,
      emb_dim: int,
      num_experts: int,
      num_experts_per_tok: int,
      moe_mlp_dim: int,
      *,
      shared_mlp_dim: int = 0,
      gate_shared: bool = True,
      normalize_top_k: bool = True,
      activation: str = "silu",
      method: str = "tiled",
      use_bias: bool = False,
      swiglu_alpha: float = 1.702,
      swiglu_limit: float = 0.0,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_experts <= 0 or moe_mlp_dim <= 0:
      raise ValueError(f"MoE needs num_experts > 0 and moe_mlp_dim > 0, got {num_experts} and {moe_mlp_dim}")
    if not 0 < num_experts_per_tok <= num_experts:
      raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {num_experts_per_tok}")
    if method not in EXPERT_METHODS:
      raise ValueError(f"MoE method must be one of {EXPERT_METHODS}, got {method!r}")
    get_activation(activation)
    if swiglu_limit < 0 or (swiglu_limit and swiglu_alpha <= 0):
      raise ValueError(
          f"MoE clamped SwiGLU needs swiglu_limit >= 0 (0 = plain SwiGLU) and swiglu_alpha > 0, got swiglu_limit="
          f"{swiglu_limit} and swiglu_alpha={swiglu_alpha}"
      )
    self.glu = (
        functools.partial(clamped_swiglu, alpha=float(swiglu_alpha), limit=float(swiglu_limit)) if swiglu_limit else None
    )
    self.top_k = int(num_experts_per_tok)
    self.normalize_top_k = bool(normalize_top_k)
    self.activation = activation
    self.method = method
    self.dtype = jnp.dtype(dtype)
    self.router = DenseGeneral(emb_dim, num_experts, use_bias=use_bias, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
    up_shape = (num_experts, emb_dim, moe_mlp_dim)
    self.gate = nnx.Param(fan_in_uniform(draw_key(rngs), up_shape, weight_dtype, emb_dim))
    self.up = nnx.Param(fan_in_uniform(draw_key(rngs), up_shape, weight_dtype, emb_dim))
    self.down = nnx.Param(fan_in_uniform(draw_key(rngs), (num_experts, moe_mlp_dim, emb_dim), weight_dtype, moe_mlp_dim))
    if use_bias:  # random (not zero) so that dummy weights exercise them
      self.gate_bias = nnx.Param(uniform(draw_key(rngs), (num_experts, moe_mlp_dim), weight_dtype, 0.1))
      self.up_bias = nnx.Param(uniform(draw_key(rngs), (num_experts, moe_mlp_dim), weight_dtype, 0.1))
      self.down_bias = nnx.Param(uniform(draw_key(rngs), (num_experts, emb_dim), weight_dtype, 0.1))
    else:
      self.gate_bias = self.up_bias = self.down_bias = None
    if shared_mlp_dim > 0:
      self.shared = MLP(emb_dim, shared_mlp_dim, activation=activation, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
      self.shared_gate = (
          DenseGeneral(emb_dim, 1, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs) if gate_shared else None
      )
    else:
      self.shared = None
      self.shared_gate = None

  @classmethod
  def declare(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: Container[str] = ()
  ) -> list[ParamDecl]:
    """The parameters of layer `layer_index`'s MoE, filled from Hugging Face's `mlp.*` (names relative to it):
    the router `gate`, the experts one by one (`experts.{e}.gate_proj.weight`, ...) or fused (transformers 5's
    `experts.gate_up_proj` / `experts.down_proj`, when `stored` holds them), and the shared expert with its gate;
    gpt-oss's biased experts in their own layout (`declare_gpt_oss`)."""
    if cfg.use_moe_bias:
      return cls.declare_gpt_oss(cfg, layer_index, stored)
    d, e, fe, fs = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_mlp_dim
    decls = [ParamDecl("router.kernel", ("embed", None), linear("gate.weight", e, d))]
    if "experts.gate_up_proj" in stored:
      gate_up = fused_gate_up("experts.gate_up_proj", e, fe, d)
      decls += [
          ParamDecl("gate", _EXPERTS_IN, gate_up, 0),
          ParamDecl("up", _EXPERTS_IN, gate_up, 1),
          ParamDecl("down", _EXPERTS_OUT, fused_down("experts.down_proj", e, fe, d)),
      ]
    else:
      experts = [f"experts.{j}." for j in range(e)]
      decls += [
          ParamDecl("gate", _EXPERTS_IN, stacked([x + "gate_proj.weight" for x in experts], fe, d)),
          ParamDecl("up", _EXPERTS_IN, stacked([x + "up_proj.weight" for x in experts], fe, d)),
          ParamDecl("down", _EXPERTS_OUT, stacked([x + "down_proj.weight" for x in experts], d, fe)),
      ]
    if fs > 0:
      decls += nest(MLP.declare(d, fs), "shared.", "shared_expert.")
      decls.append(ParamDecl("shared_gate.kernel", ("embed", None), linear("shared_expert_gate.weight", 1, d)))
    return decls

  @classmethod
  def declare_gpt_oss(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: Container[str] = ()
  ) -> list[ParamDecl]:
    """gpt-oss's MoE from `mlp.*`: `router.weight` / `router.bias`, `experts.gate_up_proj` `[E, D, 2*Fe]` with gate
    and up interleaved (and its bias `[E, 2*Fe]`), `experts.down_proj` `[E, Fe, D]` already `[in, out]`, its bias.

    Raises:
      NotImplementedError: the checkpoint stores the experts MXFP4-quantised.
    """
    if "experts.gate_up_proj_blocks" in stored:
      raise NotImplementedError(
          f"layer {layer_index}: MXFP4-quantised gpt-oss experts (experts.gate_up_proj_blocks / _scales) are not"
          " supported; load a dequantised checkpoint (transformers save_pretrained of the bf16 model)"
      )
    d, e, fe = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    gate_up = interleaved_gate_up("experts.gate_up_proj", (e, d, 2 * fe))
    gate_up_bias = interleaved_gate_up("experts.gate_up_proj_bias", (e, 2 * fe))
    return [
        ParamDecl("router.kernel", ("embed", None), linear("router.weight", e, d)),
        ParamDecl("router.bias", (None,), same("router.bias", (e,))),
        ParamDecl("gate", _EXPERTS_IN, gate_up, 0),
        ParamDecl("up", _EXPERTS_IN, gate_up, 1),
        ParamDecl("gate_bias", ("exp", "mlp"), gate_up_bias, 0),
        ParamDecl("up_bias", ("exp", "mlp"), gate_up_bias, 1),
        ParamDecl("down", _EXPERTS_OUT, same("experts.down_proj", (e, fe, d))),
        ParamDecl("down_bias", ("exp", "embed"), same("experts.down_proj_bias", (e, d))),
    ]

  @classmethod
  def declare_granite(cls, cfg: ml_collections.FrozenConfigDict, stored: Container[str] = ()) -> list[ParamDecl]:
    """Granite 4.0's MoE, names relative to the decoder layer: `block_sparse_moe.` experts (transformers 5's
    `experts.gate_up_proj` / `experts.down_proj`, or the original fused `input_linear` / `output_linear`), the
    router as `router.weight` or `router.layer.weight`, and the shared expert as the layer's `shared_mlp.`."""
    m, d = "block_sparse_moe.", cfg.base_emb_dim
    e, fe, fs = cfg.num_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_mlp_dim
    router = m + "router.layer.weight" if m + "router.layer.weight" in stored else m + "router.weight"
    fused = m + "input_linear.weight" in stored
    gate_up = fused_gate_up(m + "input_linear.weight" if fused else m + "experts.gate_up_proj", e, fe, d)
    down = m + "output_linear.weight" if fused else m + "experts.down_proj"
    return [
        ParamDecl("router.kernel", ("embed", None), linear(router, e, d)),
        ParamDecl("gate", _EXPERTS_IN, gate_up, 0),
        ParamDecl("up", _EXPERTS_IN, gate_up, 1),
        ParamDecl("down", _EXPERTS_OUT, fused_down(down, e, fe, d)),
        *nest(MLP.declare_fused(d, fs), "shared.", "shared_mlp."),
    ]

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, backend: KernelBackend | None = None
  ) -> jax.Array:
    """`[..., D] -> [..., D]`; the products and the routed experts run on `backend` (default: the reference
    backend)."""
    backend = default_backend() if backend is None else backend
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    layers = [self.router]
    if self.shared is not None:  # its gate, up and sigmoid gate read `flat` too: one `project` call with the router
      layers += [self.shared.gate, self.shared.up] + ([self.shared_gate] if self.shared_gate is not None else [])
    router_logits, *shared_inputs = project(flat, layers, backend)
    weights, indices = route(router_logits, top_k=self.top_k, normalize=self.normalize_top_k)
    y = backend.moe_experts(
        flat,
        weights,
        indices,
        self.gate[...],
        self.up[...],
        self.down[...],
        activation=get_activation(self.activation),
        dtype=self.dtype,
        method=self.method,
        **self._bias_kwargs(),
    )
    if self.shared is not None:
      shared = self.shared.finish(*shared_inputs[:2], backend)
      y = y + (shared if self.shared_gate is None else jax.nn.sigmoid(shared_inputs[2]) * shared)
    return y.reshape(*lead, y.shape[-1])

  def _bias_kwargs(self) -> dict:
    """The optional `moe_experts` arguments of this MoE (none for the plain SwiGLU experts)."""
    out = {} if self.glu is None else {"glu": self.glu}
    if self.gate_bias is not None:
      out.update(b_gate=self.gate_bias[...], b_up=self.up_bias[...], b_down=self.down_bias[...])
    return out
