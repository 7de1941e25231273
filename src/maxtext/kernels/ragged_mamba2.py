"""Ragged Mamba2 selective-state scan with per-request SSM states: the Mamba2 core of the paged path.

Approach (the same as `ragged_gated_delta_rule`): a `lax.scan` over the T tokens of the batch carries the running
state of the current request (`[nh, hd, N]` fp32) and the slot array. A request's first token loads its initial
state (its slot, or zeros when the request has no earlier tokens); its last token stores the state back into its
slot. Decodes, prefills and chunked prefills share this path; a backend with its own recurrence takes the prepared
operands (`mamba2_operands`). The per-request metadata is the Gated DeltaNet op's (`state_indices`,
`query_start_loc`, `seq_lens`, `distribution`), so both recurrent ops index state slots alike.
"""

import jax
import jax.numpy as jnp

from maxtext.kernels import ragged_batch


def _time_step(dt: jax.Array, dt_bias: jax.Array, time_step_limit: tuple[float, float]) -> jax.Array:
  """`clip(softplus(dt + dt_bias), lo, hi)` in fp32 (`hi <= 0` means no upper limit)."""
  lo, hi = time_step_limit
  out = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
  out = jnp.maximum(out, lo) if lo > 0 else out
  return jnp.minimum(out, hi) if hi > 0 else out


def _validate(
    x, dt, b, c, a_log, d, dt_bias, ssm_state, state_indices, query_start_loc, seq_lens, distribution, limit, read
):
  where = "ragged_mamba2"
  if x.ndim != 3:
    raise ValueError(f"{where}: x must be [T, nh, hd]; got shape {x.shape}")
  num_tokens, num_heads, head_dim = x.shape
  if dt.shape != (num_tokens, num_heads):
    raise ValueError(f"{where}: dt must be [T, nh] = ({num_tokens}, {num_heads}); got {dt.shape}")
  if b.ndim != 3 or b.shape[0] != num_tokens or c.shape != b.shape:
    raise ValueError(f"{where}: B and C must both be [T, G, N] with T = {num_tokens}; got B {b.shape} and C {c.shape}")
  groups, state_dim = b.shape[1:]
  if num_heads % groups:
    raise ValueError(f"{where}: nh ({num_heads}) must be a multiple of the B/C groups G ({groups})")
  for name, arr in (("A_log", a_log), ("D", d), ("dt_bias", dt_bias)):
    if arr.shape != (num_heads,):
      raise ValueError(f"{where}: {name} must be [nh] = ({num_heads},); got {arr.shape}")
  if ssm_state.ndim != 4 or ssm_state.shape[1:] != (num_heads, head_dim, state_dim):
    raise ValueError(
        f"{where}: ssm_state must be [M, nh, hd, N] = [M, {num_heads}, {head_dim}, {state_dim}]; "
        f"got {ssm_state.shape} {ssm_state.dtype}"
    )
  if ssm_state.dtype != jnp.float32:
    raise TypeError(
        f"{where}: ssm_state must be float32 (a lower precision state is re-quantized every token); "
        f"got {ssm_state.dtype}"
    )
  if len(limit) != 2 or limit[0] < 0 or 0 < limit[1] < limit[0]:
    raise ValueError(f"{where}: time_step_limit must be (lo >= 0, hi >= lo or hi = 0 for none); got {limit}")
  ragged_batch.check_state_metadata(state_indices, query_start_loc, seq_lens, distribution, where, read)


def ragged_mamba2(
    x: jax.Array,
    dt: jax.Array,
    b: jax.Array,
    c: jax.Array,
    A_log: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    D: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    dt_bias: jax.Array,
    ssm_state: jax.Array,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    time_step_limit: tuple[float, float] = (0.0, 0.0),
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Mamba2 selective scan over a ragged batch, reading and updating each request's SSM state.

  Head h reads B/C group `h // (nh / G)`. With `delta = clip(softplus(dt + dt_bias))`, `A = -exp(A_log)` and S the
  `[hd, N]` state of a head, per token: `S = exp(delta A) S + delta x B^T`, `y = S C + D x`. Padded tokens output 0;
  padded requests (index >= distribution[2]) neither read nor write a slot.

  Args:
    x: `[T, nh, hd]` SSM inputs (after the conv).
    dt: `[T, nh]` time-step projections (before softplus).
    b: `[T, G, N]` input matrices.
    c: `[T, G, N]` output matrices.
    A_log: `[nh]` log decay rates.
    D: `[nh]` skip weights.
    dt_bias: `[nh]` time-step bias.
    ssm_state: `[M, nh, hd, N]` float32 states per slot; slot 0 is the null slot.
    state_indices: `[S]` int32 slot per request.
    query_start_loc: `[S + 1]` int32 cumulative new-token counts.
    seq_lens: `[S]` int32 tokens per request after this step; a request starts from zeros when
      `seq_lens - query_len == 0`.
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    time_step_limit: `(lo, hi)` clamp of delta (`hi = 0`: no upper limit).
    read_state_indices: `[S]` int32 slot each request reads its initial state from (None: `state_indices`), as
      prefix caching's align scheme reads one state block and writes another; a null read slot means no state.

  Returns:
    `(y [T, nh, hd] in x.dtype, new_ssm_state [M, nh, hd, N] float32)`.

  Raises:
    ValueError / TypeError: inconsistent shapes, or a non-fp32 state (static checks).
  """
  xf, delta, decay = mamba2_operands(
      x,
      dt,
      b,
      c,
      A_log,
      D,
      dt_bias,
      ssm_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      time_step_limit,
      read_state_indices,
  )
  repeat = x.shape[1] // b.shape[1]
  bf = jnp.repeat(b.astype(jnp.float32), repeat, axis=1)  # [T, nh, N]
  cf = jnp.repeat(c.astype(jnp.float32), repeat, axis=1)
  skip = D.astype(jnp.float32)[:, None]  # [nh, 1]

  def update(state, xs):  # state [nh, hd, N]
    x_t, delta_t, decay_t, b_t, c_t = xs
    state = decay_t[:, None, None] * state + (delta_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
    return state, jnp.einsum("hpn,hn->hp", state, c_t) + skip * x_t

  y, new_state = ragged_batch.ragged_state_scan(
      update,
      (xf, delta, decay, bf, cf),
      ssm_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      read_state_indices,
  )
  return y.astype(x.dtype), new_state


def mamba2_operands(  # pylint: disable=too-many-positional-arguments
    x: jax.Array,
    dt: jax.Array,
    b: jax.Array,
    c: jax.Array,
    A_log: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    D: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    dt_bias: jax.Array,
    ssm_state: jax.Array,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    time_step_limit: tuple[float, float] = (0.0, 0.0),
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Checks `ragged_mamba2`'s operands (same arguments) and returns the recurrence's float32 inputs.

  A backend with its own recurrence calls it, then runs the recurrence on these (with B, C and D as given).

  Returns:
    `(x [T, nh, hd], delta [T, nh], decay [T, nh])` float32: `delta = clip(softplus(dt + dt_bias))`,
    `decay = exp(-delta exp(A_log))`.

  Raises:
    ValueError / TypeError: as `ragged_mamba2`.
  """
  _validate(
      x,
      dt,
      b,
      c,
      A_log,
      D,
      dt_bias,
      ssm_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      time_step_limit,
      read_state_indices,
  )
  delta = _time_step(dt, dt_bias, time_step_limit)  # [T, nh]
  return x.astype(jnp.float32), delta, jnp.exp(delta * -jnp.exp(A_log.astype(jnp.float32)))
