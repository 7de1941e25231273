"""Ragged causal depthwise conv1d with a per-request state: the GDN input conv of the paged path.

The runner's algorithm (docs/runner-contract.md): each real request r convolves its new tokens `x_r` over
`[conv_state[slot] (K - 1 rows); x_r]` (zeros instead of the stored rows when the request has no earlier tokens),
applies SiLU, and stores the last K - 1 raw rows of that concatenation back into its slot. Fully vectorised:
every output row gathers its K taps, either from `x` or from the request's stored rows, so decodes, prefills and
chunked prefills share one code path.
"""

import jax
import jax.numpy as jnp

from maxtext.kernels import ragged_batch


def _validate(x, conv_state, weight, bias, state_indices, query_start_loc, seq_lens, distribution, read) -> None:
  where = "ragged_conv1d"
  if x.ndim != 2:
    raise ValueError(f"{where}: x must be [T, C]; got shape {x.shape}")
  channels = x.shape[1]
  if weight.ndim != 3 or weight.shape[:2] != (channels, 1) or weight.shape[2] < 2:
    raise ValueError(f"{where}: weight must be [C, 1, K] = [{channels}, 1, K] with K >= 2; got {weight.shape}")
  width = weight.shape[2]
  if conv_state.ndim != 3 or conv_state.shape[1:] != (width - 1, channels):
    raise ValueError(
        f"{where}: conv_state must be [M, K - 1, C] = [M, {width - 1}, {channels}]; "
        f"got {conv_state.shape} {conv_state.dtype}"
    )
  if bias is not None and bias.shape != (channels,):
    raise ValueError(f"{where}: bias must be [C] = ({channels},) or None; got {bias.shape}")
  ragged_batch.check_state_metadata(state_indices, query_start_loc, seq_lens, distribution, where, read)


def ragged_conv1d(
    x: jax.Array,
    conv_state: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    read_state_indices: jax.Array | None = None,
    *,
    sum_taps: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv + SiLU over a ragged batch, reading and updating each request's conv state.

  `y_t = silu(sum_k weight[:, 0, k] * x_{t - K + 1 + k} + bias)` in fp32, where rows before the request's first
  new token come from its stored state. Padded tokens output 0; padded requests (index >= distribution[2]) neither
  read nor write a slot, so the null slot 0 they point at is untouched.

  Args:
    x: `[T, C]` new conv inputs (the `[q | k | v]` channels of GDN).
    conv_state: `[M, K - 1, C]` stored raw input rows per slot (any float dtype, e.g. bf16), oldest first.
    weight: `[C, 1, K]` depthwise kernel, the runner's layout (MaxText's `(K, 1, C)` transposed by `(2, 1, 0)`).
    bias: `[C]` or None.
    state_indices: `[S]` int32 slot per request: where its new state is written.
    query_start_loc: `[S + 1]` int32 cumulative new-token counts.
    seq_lens: `[S]` int32 tokens per request after this step; the state is read only if
      `seq_lens - query_len > 0` (and the read slot is not the null slot 0).
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    read_state_indices: `[S]` int32 slot each request reads its initial state from (None: `state_indices`);
      prefix caching resumes from one state block and checkpoints into another.
    sum_taps: form the taps' sum as a product and a sum over K rather than a contraction (a dot): the same values,
      in the form a backend whose small programs compile without YNNPACK's fusions wants at a few rows.

  Returns:
    `(y [T, C] in x.dtype, new_conv_state [M, K - 1, C])`; the new state of a request is the last K - 1 raw rows
    of `[old rows (or zeros); x_r]`, cast to the state dtype.

  Raises:
    ValueError: inconsistent shapes (static checks).
  """
  _validate(x, conv_state, weight, bias, state_indices, query_start_loc, seq_lens, distribution, read_state_indices)
  num_tokens = x.shape[0]
  num_slots, hist, _ = conv_state.shape  # hist = K - 1
  width = hist + 1
  state_indices = state_indices.astype(jnp.int32)
  read = state_indices if read_state_indices is None else read_state_indices.astype(jnp.int32)
  qsl = query_start_loc.astype(jnp.int32)
  layout = ragged_batch.token_layout(num_tokens, qsl, distribution)
  has_init = ragged_batch.has_initial_state(layout, seq_lens, read_state_indices)
  # [S, K - 1, C]: each request's rows preceding its first new token (zeros without a restored state).
  init_rows = jnp.where(has_init[:, None, None], conv_state[read], jnp.zeros((), conv_state.dtype))

  def rows_before(end: jax.Array, request: jax.Array, count: int) -> jax.Array:
    """Candidates for the `count` rows ending before token `end` of `request` (its state rows, then its x).

    Returns `(from_x, from_state, in_chunk)`: row candidates from x and from the stored rows, and which to use.
    """
    start = qsl[request]
    offsets = end[..., None] - count + jnp.arange(count, dtype=jnp.int32)  # absolute token index of each row
    from_x = x[jnp.clip(offsets, 0, num_tokens - 1)]
    from_state = init_rows[request[..., None], jnp.clip(hist - start[..., None] + offsets, 0, hist - 1)]
    return from_x, from_state, offsets >= start[..., None]

  # Output rows: the K taps of token t are the K rows ending at t (inclusive).
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  from_x, from_state, in_chunk = rows_before(tokens + 1, layout.request_ids, width)  # [T, K, C] each
  window = jnp.where(in_chunk[..., None], from_x.astype(jnp.float32), from_state.astype(jnp.float32))
  taps = weight[:, 0, :].astype(jnp.float32)  # [C, K]
  if sum_taps:
    # One fused loop of XLA's, with no dot call and no transpose of the taps, for a handful of rows.
    y = jnp.sum(window * taps.T, axis=1)
  else:
    # YNNPACK runs the contraction as a dot, which beats its fusion of the product and sum at many rows.
    y = jnp.einsum("tkc,ck->tc", window, taps)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  y = jnp.where(layout.token_valid[:, None], jax.nn.silu(y), 0.0).astype(x.dtype)

  # New state rows: the K - 1 rows ending at the request's last new token.
  requests = jnp.arange(state_indices.shape[0], dtype=jnp.int32)
  from_x, from_state, in_chunk = rows_before(qsl[1:], requests, hist)  # [S, K - 1, C] each
  new_rows = jnp.where(in_chunk[..., None], from_x.astype(conv_state.dtype), from_state)
  targets = jnp.where(layout.request_valid, state_indices, num_slots)  # out of range: dropped
  new_state = conv_state.at[targets].set(new_rows, mode="drop")
  return y, new_state
