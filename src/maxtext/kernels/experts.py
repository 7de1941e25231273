"""Routed-expert computation of a mixture of experts: the MoE op the kernel backend serves.

`experts_dense` runs every expert on every token and combines with a sparse weight matrix (the simplest exact
form, fine for tiny models); `experts_gather` gathers the selected experts' weights per token. Both take the
router's top-k weights and indices and the stacked expert weights, and return the combined output.

Every form also takes optional per-expert biases (`b_gate`, `b_up` `[E, F]`, `b_down` `[E, D]`, gpt-oss) and an
optional `glu(gate, up)` that replaces `activation(gate) * up` (gpt-oss's clamped SwiGLU); without them the result
is exactly that of the plain gated expert MLP.
"""

from typing import Callable

import jax
import jax.numpy as jnp

Glu = Callable[[jax.Array, jax.Array], jax.Array]


def check_biases(w_gate: jax.Array, b_gate, b_up, b_down) -> None:
  """Bias shapes: `b_gate`, `b_up` `[E, F]` and `b_down` `[E, D]` of `w_gate [E, D, F]` (each may be None)."""
  num_experts, emb_dim, mlp_dim = w_gate.shape
  for name, bias, shape in (
      ("b_gate", b_gate, (num_experts, mlp_dim)),
      ("b_up", b_up, (num_experts, mlp_dim)),
      ("b_down", b_down, (num_experts, emb_dim)),
  ):
    if bias is not None and bias.shape != shape:
      raise ValueError(f"the MoE experts need {name} of shape {shape} (w_gate {w_gate.shape}); got {bias.shape}")


def add_bias(y: jax.Array, bias: jax.Array | None, rows: jax.Array | slice, dtype: jnp.dtype) -> jax.Array:
  """`y + bias[rows]` (cast to `dtype`), or `y` when there is no bias."""
  return y if bias is None else y + jnp.asarray(bias, dtype)[rows]


def gated(gate: jax.Array, up: jax.Array, activation: Callable[[jax.Array], jax.Array], glu: Glu | None) -> jax.Array:
  """The expert's hidden activations: `glu(gate, up)` when given, else `activation(gate) * up`."""
  return activation(gate) * up if glu is None else glu(gate, up)


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
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    glu: Glu | None = None,
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
    b_gate, b_up: `[E, F]` biases of the gate and up projections, or None.
    b_down: `[E, D]` bias of the down projection (weighted like the expert's output), or None.
    glu: `(gate, up) -> hidden` replacing `activation(gate) * up`, or None.

  Returns:
    `[T, D]` in `dtype`.
  """
  check_biases(w_gate, b_gate, b_up, b_down)
  x = x.astype(dtype)
  combine = jnp.einsum("tk,tke->te", weights.astype(dtype), jax.nn.one_hot(indices, w_gate.shape[0], dtype=dtype))
  gate = add_bias(jnp.einsum("td,edf->tef", x, w_gate.astype(dtype)), b_gate, slice(None), dtype)
  up = add_bias(jnp.einsum("td,edf->tef", x, w_up.astype(dtype)), b_up, slice(None), dtype)
  y = add_bias(
      jnp.einsum("tef,efd->ted", gated(gate, up, activation, glu), w_down.astype(dtype)), b_down, slice(None), dtype
  )
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
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    glu: Glu | None = None,
) -> jax.Array:
  """Only the selected experts per token, by gathering their weights (`[T, k, D, F]` memory).

  Same arguments and result as `experts_dense`.
  """
  check_biases(w_gate, b_gate, b_up, b_down)
  x = x.astype(dtype)
  g = w_gate.astype(dtype)[indices]  # [T, k, D, F]
  u = w_up.astype(dtype)[indices]
  d = w_down.astype(dtype)[indices]  # [T, k, F, D]
  gate = add_bias(jnp.einsum("td,tkdf->tkf", x, g), b_gate, indices, dtype)
  up = add_bias(jnp.einsum("td,tkdf->tkf", x, u), b_up, indices, dtype)
  y = add_bias(jnp.einsum("tkf,tkfd->tkd", gated(gate, up, activation, glu), d), b_down, indices, dtype)
  return jnp.einsum("tk,tkd->td", weights.astype(dtype), y)
