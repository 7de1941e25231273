"""Ragged gated delta rule with per-request recurrent states: the GDN core of the paged path (docs/runner-contract.md).

Approach: a `lax.scan` over the T tokens of the batch, carrying the running state of the current request
(`[nv, dk, dv]` fp32) and the slot array. A request's first token loads its initial state (its slot, or zeros
without earlier tokens); its last token stores the state back into its slot. Decodes, prefills and chunked
prefills share this path; the sequential cost is one small step per token, fine for CPU-sized batches. The
per-token algebra is the recurrent form of the gated delta rule; a TPU backend replaces the whole function, and
a backend with its own recurrence takes the prepared operands (`gated_delta_operands`) and runs it its way.
"""

import jax
import jax.numpy as jnp

from maxtext.kernels import ragged_batch

_L2_EPS = 1e-6


def _l2_normalize(x: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def _validate(
    q, k, v, b, a, a_log, dt_bias, recurrent_state, state_indices, query_start_loc, seq_lens, distribution, read
):
  where = "ragged_gated_delta_rule"
  if q.ndim != 3 or k.shape != q.shape:
    raise ValueError(f"{where}: q and k must both be [T, nk, dk]; got q {q.shape} and k {k.shape}")
  num_tokens, num_k_heads, key_dim = q.shape
  if v.ndim != 3 or v.shape[0] != num_tokens:
    raise ValueError(f"{where}: v must be [T, nv, dv] with T = {num_tokens}; got {v.shape}")
  num_v_heads, value_dim = v.shape[1:]
  if num_v_heads % num_k_heads:
    raise ValueError(f"{where}: nv ({num_v_heads}) must be a multiple of nk ({num_k_heads})")
  for name, arr in (("b", b), ("a", a)):
    if arr.shape != (num_tokens, num_v_heads):
      raise ValueError(f"{where}: {name} must be [T, nv] = ({num_tokens}, {num_v_heads}); got {arr.shape}")
  for name, arr in (("A_log", a_log), ("dt_bias", dt_bias)):
    if arr.shape != (num_v_heads,):
      raise ValueError(f"{where}: {name} must be [nv] = ({num_v_heads},); got {arr.shape}")
  if recurrent_state.ndim != 4 or recurrent_state.shape[1:] != (num_v_heads, key_dim, value_dim):
    raise ValueError(
        f"{where}: recurrent_state must be [M, nv, dk, dv] = [M, {num_v_heads}, {key_dim}, {value_dim}]; "
        f"got {recurrent_state.shape} {recurrent_state.dtype}"
    )
  if recurrent_state.dtype != jnp.float32:
    raise TypeError(
        f"{where}: recurrent_state must be float32 (a lower precision state is re-quantized every token); "
        f"got {recurrent_state.dtype}"
    )
  ragged_batch.check_state_metadata(state_indices, query_start_loc, seq_lens, distribution, where, read)


def ragged_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    b: jax.Array,
    a: jax.Array,
    A_log: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    dt_bias: jax.Array,
    recurrent_state: jax.Array,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Gated delta rule over a ragged batch, reading and updating each request's recurrent state.

  Value head j uses key head `j // (nv / nk)`. q and k are L2-normalised in fp32 (`x / sqrt(sum x^2 + 1e-6)`),
  q is scaled by `dk ** -0.5`, `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`, and per token, with
  `e = exp(g)` and S the `[dk, dv]` state of a head:
  `v' = beta * (v - e * k^T S)`, `out = e * q^T S + (q . k) v'`, `S = e * S + k (x) v'`.
  Padded tokens output 0; padded requests (index >= distribution[2]) neither read nor write a slot.

  Args:
    q: `[T, nk, dk]` queries (after the conv).
    k: `[T, nk, dk]` keys.
    v: `[T, nv, dv]` values (the output has their dtype).
    b: `[T, nv]` beta logits.
    a: `[T, nv]` decay inputs.
    A_log: `[nv]` log decay rates.
    dt_bias: `[nv]` decay bias.
    recurrent_state: `[M, nv, dk, dv]` float32 states per slot; slot 0 is the null slot.
    state_indices: `[S]` int32 slot per request: where its final state is written.
    query_start_loc: `[S + 1]` int32 cumulative new-token counts.
    seq_lens: `[S]` int32 tokens per request after this step; a request starts from zeros when
      `seq_lens - query_len == 0` (or its read slot is the null slot 0).
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    read_state_indices: `[S]` int32 slot each request reads its initial state from (None: `state_indices`).

  Returns:
    `(out [T, nv, dv] in v.dtype, new_recurrent_state [M, nv, dk, dv] float32)`.

  Raises:
    ValueError / TypeError: inconsistent shapes, or a non-fp32 recurrent state (static checks).
  """
  qf, kf, vf, beta, decay = gated_delta_operands(
      q,
      k,
      v,
      b,
      a,
      A_log,
      dt_bias,
      recurrent_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      read_state_indices,
  )

  def update(state, xs):  # state [nv, dk, dv]
    q_t, k_t, v_t, beta_t, e_t = xs
    k_state = jnp.einsum("hk,hkv->hv", k_t, state)
    q_state = jnp.einsum("hk,hkv->hv", q_t, state)
    v_new = beta_t[:, None] * (v_t - e_t[:, None] * k_state)
    out = e_t[:, None] * q_state + jnp.sum(q_t * k_t, axis=-1)[:, None] * v_new
    return e_t[:, None, None] * state + k_t[:, :, None] * v_new[:, None, :], out

  out, new_state = ragged_batch.ragged_state_scan(
      update,
      (qf, kf, vf, beta, decay),
      recurrent_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      read_state_indices,
  )
  return out.astype(v.dtype), new_state


def gated_delta_operands(  # pylint: disable=too-many-positional-arguments
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    b: jax.Array,
    a: jax.Array,
    A_log: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
    dt_bias: jax.Array,
    recurrent_state: jax.Array,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Checks `ragged_gated_delta_rule`'s operands (same arguments) and returns the recurrence's float32 inputs.

  A backend with its own recurrence calls it, then runs the recurrence on these.

  Returns:
    `(q [T, nv, dk] normalised and scaled, k [T, nv, dk] normalised, v [T, nv, dv], beta [T, nv], decay [T, nv])`,
    all float32, each key head repeated over its value heads.

  Raises:
    ValueError / TypeError: as `ragged_gated_delta_rule`.
  """
  _validate(
      q,
      k,
      v,
      b,
      a,
      A_log,
      dt_bias,
      recurrent_state,
      state_indices,
      query_start_loc,
      seq_lens,
      distribution,
      read_state_indices,
  )
  num_k_heads, key_dim = q.shape[1:]
  repeat = v.shape[1] // num_k_heads
  qf = _l2_normalize(jnp.repeat(q.astype(jnp.float32), repeat, axis=1)) * key_dim**-0.5  # [T, nv, dk]
  kf = _l2_normalize(jnp.repeat(k.astype(jnp.float32), repeat, axis=1))
  vf = v.astype(jnp.float32)
  beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [T, nv]
  decay = jnp.exp(
      -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
  )
  return qf, kf, vf, beta, decay
