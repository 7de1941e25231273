"""Mixture of experts: softmax top-k router, stacked SwiGLU experts, optional sigmoid-gated shared expert."""

import logging
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.kernels.moe import experts_ragged, experts_tiled
from maxtext.layers.initializers import draw_key, fan_in_uniform
from maxtext.layers.linears import DenseGeneral
from maxtext.layers.mlp import MLP, get_activation

logger = logging.getLogger(__name__)

# tiled: the selected experts only, a loop over expert tiles of the rows sorted by expert (the default: on CPU it is
# 3-12x faster than dense, see docs/benchmarks.md); ragged: the same grouped matmul as `jax.lax.ragged_dot` (for
# backends with a native grouped matmul); dense: every expert on every token (reference); gather: [T, k, D, F]
# weight copies (small T only).
EXPERT_METHODS = ("tiled", "ragged", "dense", "gather")


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


def experts_dense(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dtype: jnp.dtype,
) -> jax.Array:
  """Every expert on every token, combined with a sparse `[T, E]` weight matrix (tiny sizes / reference).

  Args:
    x: `[T, D]` tokens.
    weights: `[T, k]` routing weights.
    indices: `[T, k]` expert ids.
    w_gate: `[E, D, F]`.
    w_up: `[E, D, F]`.
    w_down: `[E, F, D]`.
    activation: gate activation.
    dtype: compute dtype.

  Returns:
    `[T, D]` in `dtype`.
  """
  x = x.astype(dtype)
  combine = jnp.einsum("tk,tke->te", weights.astype(dtype), jax.nn.one_hot(indices, w_gate.shape[0], dtype=dtype))
  h = activation(jnp.einsum("td,edf->tef", x, w_gate.astype(dtype))) * jnp.einsum("td,edf->tef", x, w_up.astype(dtype))
  y = jnp.einsum("tef,efd->ted", h, w_down.astype(dtype))
  return jnp.einsum("te,ted->td", combine, y)


def experts_gather(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dtype: jnp.dtype,
) -> jax.Array:
  """Only the selected experts per token, by gathering their weights (`[T, k, D, F]` memory).

  Same arguments and result as `experts_dense`.
  """
  x = x.astype(dtype)
  g = w_gate.astype(dtype)[indices]  # [T, k, D, F]
  u = w_up.astype(dtype)[indices]
  d = w_down.astype(dtype)[indices]  # [T, k, F, D]
  h = activation(jnp.einsum("td,tkdf->tkf", x, g)) * jnp.einsum("td,tkdf->tkf", x, u)
  y = jnp.einsum("tkf,tkfd->tkd", h, d)
  return jnp.einsum("tk,tkd->td", weights.astype(dtype), y)


class MoE(nnx.Module):
  """Routed experts plus an optional shared expert.

  Parameters: `router.kernel [D, E]`, `gate [E, D, Fe]`, `up [E, D, Fe]`, `down [E, Fe, D]`, and when
  `shared_mlp_dim > 0`: `shared.{gate,up,down}.kernel`, `shared_gate.kernel [D, 1]`.
  """

  def __init__(
      self,
      emb_dim: int,
      num_experts: int,
      num_experts_per_tok: int,
      moe_mlp_dim: int,
      *,
      shared_mlp_dim: int = 0,
      normalize_top_k: bool = True,
      activation: str = "silu",
      method: str = "tiled",
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
    self.top_k = int(num_experts_per_tok)
    self.normalize_top_k = bool(normalize_top_k)
    self.activation = activation
    self.method = method
    self.dtype = jnp.dtype(dtype)
    self.router = DenseGeneral(emb_dim, num_experts, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
    up_shape = (num_experts, emb_dim, moe_mlp_dim)
    self.gate = nnx.Param(fan_in_uniform(draw_key(rngs), up_shape, weight_dtype, emb_dim))
    self.up = nnx.Param(fan_in_uniform(draw_key(rngs), up_shape, weight_dtype, emb_dim))
    self.down = nnx.Param(fan_in_uniform(draw_key(rngs), (num_experts, moe_mlp_dim, emb_dim), weight_dtype, moe_mlp_dim))
    if shared_mlp_dim > 0:
      self.shared = MLP(emb_dim, shared_mlp_dim, activation=activation, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
      self.shared_gate = DenseGeneral(emb_dim, 1, dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
    else:
      self.shared = None
      self.shared_gate = None

  def __call__(self, x: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """`[..., D] -> [..., D]`."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    weights, indices = route(self.router(flat), top_k=self.top_k, normalize=self.normalize_top_k)
    fn = {"tiled": experts_tiled, "ragged": experts_ragged, "dense": experts_dense, "gather": experts_gather}[self.method]
    y = fn(
        flat,
        weights,
        indices,
        self.gate[...],
        self.up[...],
        self.down[...],
        activation=get_activation(self.activation),
        dtype=self.dtype,
    )
    if self.shared is not None:
      y = y + jax.nn.sigmoid(self.shared_gate(flat)) * self.shared(flat)
    return y.reshape(*lead, y.shape[-1])
