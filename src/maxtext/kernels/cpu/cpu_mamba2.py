"""Mamba2's selective-state recurrence over a ragged batch by the CPU kernel library (`cpu/mamba2.cc`).

In XLA, `ragged_mamba2` runs a batch of decodes as a gather of each token's `[H, hd, N]` state, the new states
computed into a buffer of their own and a scatter back into the slots, and any batch with a longer request as a loop
over its tokens, both behind a conditional that copies the states in and out. The kernel runs each (request,
head)'s tokens in order on the state in the slot the request writes, and updates the states in place (their buffer
is aliased to the result), as `cpu_gated_delta` does for Gated DeltaNet. The `cpu` kernel backend runs the
recurrence by `mamba2` when `cpu_gated_delta.applies` says so (float32, the library loaded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext.kernels.cpu import cpu_gated_delta, cpu_gemm


def mamba2(
    x: jax.Array,
    delta: jax.Array,
    decay: jax.Array,
    b: jax.Array,
    c: jax.Array,
    skip: jax.Array,
    query_start_loc: jax.Array,
    read: jax.Array,
    write: jax.Array,
    distribution: jax.Array,
    states: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Mamba2's recurrence over a ragged batch, the states updated in place (call `cpu_gemm.load()` first).

  Request r < `distribution[2]` owns tokens `[query_start_loc[r], query_start_loc[r + 1])`. It starts from
  `states[read[r]]` (zeros when `read[r]` is outside `[0, M)`); per token and head h, with S its `[hd, N]` state and
  `B`, `C` the rows of the head's group `h // (H / G)`: `S = decay * S + (delta * x) B^T`, `y = S C + skip * x`. Its
  final state goes to `states[write[r]]` when `write[r]` is in `[0, M)` (of two requests writing one slot, the later
  one's stays), else nowhere; a request without tokens reads and writes nothing. Every request reads the states as
  they were before the call. Tokens of no request output zeros.

  Args:
    x: `[T, H, hd]` float32 inputs.
    delta: `[T, H]` float32 time steps.
    decay: `[T, H]` float32 decays `exp(delta * A)`.
    b: `[T, G, N]` float32 input matrices (H a multiple of G).
    c: `[T, G, N]` float32 output matrices.
    skip: `[H]` float32 skip weights (D).
    query_start_loc: `[S + 1]` int32 cumulative token counts.
    read: `[S]` int32 slot each request starts from.
    write: `[S]` int32 slot each request's final state goes to.
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    states: `[M, H, hd, N]` float32 state slots.

  Returns:
    `(y [T, H, hd], new states [M, H, hd, N])`, float32.

  Raises:
    ValueError: shapes that do not match, or operands that are not float32 (int32 metadata).
  """
  if x.ndim != 3 or b.ndim != 3 or read.ndim != 1:
    raise ValueError(
        f"mamba2 takes x [T, H, hd], B [T, G, N] and read [S]; got x {x.shape}, B {b.shape}, read {read.shape}"
    )
  (num_tokens, heads, head_dim), (groups, state_dim), num_requests = x.shape, b.shape[1:], read.shape[0]
  if groups < 1 or heads % groups:
    raise ValueError(f"mamba2: the heads of x ({heads}) must be a multiple of B's groups ({groups})")
  expected = {
      "x": (num_tokens, heads, head_dim),
      "delta": (num_tokens, heads),
      "decay": (num_tokens, heads),
      "b": (num_tokens, groups, state_dim),
      "c": (num_tokens, groups, state_dim),
      "skip": (heads,),
      "query_start_loc": (num_requests + 1,),
      "read": (num_requests,),
      "write": (num_requests,),
      "distribution": (3,),
      "states": (states.shape[0] if states.ndim == 4 else -1, heads, head_dim, state_dim),
  }
  operands = (x, delta, decay, b, c, skip, query_start_loc, read, write, distribution, states)
  cpu_gated_delta.check_operands("mamba2", expected, operands, f"from x {x.shape}, B {b.shape} and read {read.shape}")
  y = jax.ShapeDtypeStruct((num_tokens, heads, head_dim), jnp.float32)
  new_states = jax.ShapeDtypeStruct(states.shape, jnp.float32)
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS["mamba2"][0], (y, new_states), input_output_aliases={10: 1})
  return tuple(call(*operands))
