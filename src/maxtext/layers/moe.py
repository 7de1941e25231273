"""Mixture of experts: softmax top-k router, stacked SwiGLU experts, optional shared expert (sigmoid-gated or plain).

gpt-oss adds a router bias, per-expert biases and the clamped SwiGLU (`clamped_swiglu`); its softmax over the top-k
logits equals the softmax over all experts renormalised over the top k (`normalize=True`).
The routed-expert computation itself is the kernel backend's `moe_experts` op.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.kernels.backend import EXPERT_METHODS, KernelBackend, default_backend
from maxtext.layers.initializers import draw_key, fan_in_uniform, uniform
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.mlp import MLP, clamped_swiglu, get_activation


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
