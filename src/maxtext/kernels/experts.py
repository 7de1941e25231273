"""Routed-expert computation of a mixture of experts: the MoE op the kernel backend serves.

`experts_dense` runs every expert on every token and combines with a sparse weight matrix (the simplest exact
form, fine for tiny models); `experts_gather` gathers the selected experts' weights per token. Both take the
router's top-k weights and indices and the stacked expert weights, and return the combined output.
"""

from typing import Callable

import jax
import jax.numpy as jnp


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
