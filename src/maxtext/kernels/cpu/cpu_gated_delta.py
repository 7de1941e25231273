"""The gated delta rule (Gated DeltaNet) over a ragged batch by the CPU kernel library (`cpu/gated_delta.cc`).

In XLA, `ragged_gated_delta_rule` runs a batch of decodes as a gather of each token's `[H, dk, dv]` state, the new
states computed into a buffer of their own and a scatter back into the slots, and any batch with a longer request
as a loop over its tokens; a program that may see either holds both behind a conditional, which copies the states
in and out. The kernel runs each (request, head)'s tokens in order on the state in the slot the request writes, and
updates the states in place (their buffer is aliased to the result). `ragged_gated_delta_rule` hands the recurrence
to `gated_delta` when `applies` says so: for the `cpu` kernel backend (`backend.CpuBackend`),
for float32 inputs and states, once the kernel library has loaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext.kernels.cpu import cpu_gemm


def applies(*dtypes: jnp.dtype) -> bool:
  """Whether the `cpu` backend should run a recurrence (gated delta rule, Mamba2) on the kernel.

  True when every dtype given (inputs and states) is float32, once `cpu_gemm.load()` has succeeded.
  """
  return all(jnp.dtype(d) == jnp.float32 for d in dtypes) and cpu_gemm.load()


def gated_delta(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    beta: jax.Array,
    decay: jax.Array,
    query_start_loc: jax.Array,
    read: jax.Array,
    write: jax.Array,
    distribution: jax.Array,
    states: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule over a ragged batch, the states updated in place (call `cpu_gemm.load()` first).

  Request r < `distribution[2]` owns tokens `[query_start_loc[r], query_start_loc[r + 1])`. It starts from
  `states[read[r]]` (zeros when `read[r]` is outside `[0, M)`); per token and value head, with S its `[dk, dv]`
  state and `e` the decay: `v' = beta * (v - e * k^T S)`, `out = e * q^T S + (q . k) v'`, `S = e * S + k (x) v'`.
  Its final state goes to `states[write[r]]` when `write[r]` is in `[0, M)` (of two requests writing one slot, the
  later one's stays), else nowhere; a request without tokens reads and writes nothing. Every request reads the
  states as they were before the call. Tokens of no request output zeros.

  Args:
    q: `[T, H, dk]` float32 queries (L2-normalised and scaled, one per value head).
    k: `[T, H, dk]` float32 keys (L2-normalised).
    v: `[T, H, dv]` float32 values.
    beta: `[T, H]` float32 write strengths.
    decay: `[T, H]` float32 decays `e`.
    query_start_loc: `[S + 1]` int32 cumulative token counts.
    read: `[S]` int32 slot each request starts from.
    write: `[S]` int32 slot each request's final state goes to.
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    states: `[M, H, dk, dv]` float32 state slots.

  Returns:
    `(out [T, H, dv], new states [M, H, dk, dv])`, float32.

  Raises:
    ValueError: shapes that do not match, or operands that are not float32 (int32 metadata).
  """
  if q.ndim != 3 or v.ndim != 3 or read.ndim != 1:
    raise ValueError(
        f"gated delta takes q [T, H, dk], v [T, H, dv] and read [S]; got q {q.shape}, v {v.shape}, read {read.shape}"
    )
  (num_tokens, heads, key_dim), value_dim, num_requests = q.shape, v.shape[2], read.shape[0]
  expected = {
      "q": (num_tokens, heads, key_dim),
      "k": (num_tokens, heads, key_dim),
      "v": (num_tokens, heads, value_dim),
      "beta": (num_tokens, heads),
      "decay": (num_tokens, heads),
      "query_start_loc": (num_requests + 1,),
      "read": (num_requests,),
      "write": (num_requests,),
      "distribution": (3,),
      "states": (states.shape[0] if states.ndim == 4 else -1, heads, key_dim, value_dim),
  }
  operands = (q, k, v, beta, decay, query_start_loc, read, write, distribution, states)
  check_operands("gated delta", expected, operands, f"from q {q.shape}, v {v.shape} and read {read.shape}")
  out = jax.ShapeDtypeStruct((num_tokens, heads, value_dim), jnp.float32)
  new_states = jax.ShapeDtypeStruct(states.shape, jnp.float32)
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS["gated_delta"][0], (out, new_states), input_output_aliases={9: 1})
  return tuple(call(*operands))


_METADATA = ("query_start_loc", "read", "write", "distribution")


def check_operands(kernel: str, expected: dict[str, tuple[int, ...]], operands: tuple, source: str) -> None:
  """Checks a recurrent kernel's operands, given in the order of `expected` (name -> shape): each has its shape,
  the ragged metadata (`query_start_loc`, `read`, `write`, `distribution`) int32 and the others float32.

  Raises:
    ValueError: naming the kernel, the operand, its shape or dtype and what was expected (`source`: the operands
      the expected shapes come from).
  """
  for (name, shape), array in zip(expected.items(), operands):
    if tuple(array.shape) != shape:
      raise ValueError(f"{kernel}: {name} has shape {tuple(array.shape)}, expected {shape} ({source})")
    if array.dtype != (jnp.int32 if name in _METADATA else jnp.float32):
      raise ValueError(f"{kernel} takes float32 values and int32 metadata; {name} is {array.dtype}")
