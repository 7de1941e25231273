"""Routed experts by the CPU kernel library's expert products (`cpu_gemm.expert_matmul(s)`).

The `cpu` kernel backend's `moe_experts` for float32 batches of up to `cpu_gemm.MAX_EXPERT_ROWS` (token, choice)
rows (`cpu_gemm.applies_experts`), whatever the method asked for: every row is multiplied by its expert's matrices
where they lie in the stacked weights.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from maxtext.kernels import moe
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.experts import Glu, add_bias, check_biases, gated


def experts_cpu_rows(
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
  """`experts_ragged`'s result by the CPU kernel's `expert_matmul`, which reads each selected matrix in place.

  Every (token, choice) row is multiplied by its expert's matrices where they lie in the stacked weights: no sort,
  no loop and no copy of expert weights (a loop over experts with `w[e]` copies each matrix before its product).
  For float32 on the CPU (`cpu_gemm.applies_experts`); same arguments, result and errors as `experts_ragged`.
  """
  moe.check_shapes(x, weights, indices, w_gate, w_up, w_down)
  check_biases(w_gate, b_gate, b_up, b_down)
  num_tokens, top_k = indices.shape
  expert_of_row = indices.reshape(-1).astype(jnp.int32)  # flat row t * k + j
  rows = jnp.repeat(x.astype(dtype), top_k, axis=0)  # [T * k, D]
  gate, up = cpu_gemm.expert_matmuls(rows, (w_gate.astype(dtype), w_up.astype(dtype)), expert_of_row)  # one call
  gate, up = add_bias(gate, b_gate, expert_of_row, dtype), add_bias(up, b_up, expert_of_row, dtype)
  hidden = gated(gate, up, activation, glu)  # [T * k, F]
  y = add_bias(cpu_gemm.expert_matmul(hidden, w_down.astype(dtype), expert_of_row), b_down, expert_of_row, dtype)
  return jnp.einsum("tk,tkd->td", weights.astype(dtype), y.reshape(num_tokens, top_k, -1))
