"""Which request owns each token of a ragged batch, shared by the ragged kernels.

A ragged batch packs the tokens of up to S requests back to back: request i owns tokens
`[query_start_loc[i], query_start_loc[i + 1])`, and only requests `i < distribution[2]` are real. Tokens from
`query_start_loc[distribution[2]]` on are padding (the token count is bucketed), as are the request rows beyond
`distribution[2]`. Everything here is static-shape and jit-compatible.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

NULL_STATE_SLOT = 0  # the null slot: padded requests point at it; reading it means "no state restored"


class TokenLayout(NamedTuple):
  """Per-token and per-request views of a ragged batch (all int32 / bool arrays).

  Attributes:
    request_ids: `[T]` request owning each token, clipped to `[0, S)` (meaningless where `token_valid` is False).
    token_valid: `[T]` token lies in the range of a real request (so index `< query_start_loc[distribution[2]]`).
    token_offsets: `[T]` index of the token within its request's new tokens (0 for its first token).
    query_lens: `[S]` new tokens per request (0 for padded requests).
    request_valid: `[S]` request index `< distribution[2]`.
    num_valid_requests: scalar `distribution[2]`.
  """

  request_ids: jax.Array
  token_valid: jax.Array
  token_offsets: jax.Array
  query_lens: jax.Array
  request_valid: jax.Array
  num_valid_requests: jax.Array


def check_ragged_metadata(num_requests: int, query_start_loc: jax.Array, distribution: jax.Array, where: str) -> None:
  """Checks the static shapes of the ragged batch description.

  Raises:
    ValueError: there is no request row, `query_start_loc` is not `[S + 1]` or `distribution` is not `[3]`.
  """
  if num_requests < 1:
    raise ValueError(f"{where}: the batch needs at least one request row (S >= 1); got S = {num_requests}")
  if query_start_loc.shape != (num_requests + 1,):
    raise ValueError(
        f"{where}: query_start_loc must have shape (S + 1,) = ({num_requests + 1},) for S = {num_requests} requests; "
        f"got {query_start_loc.shape}"
    )
  if distribution.shape != (3,):
    raise ValueError(f"{where}: distribution must have shape (3,); got {distribution.shape}")


def token_layout(num_tokens: int, query_start_loc: jax.Array, distribution: jax.Array) -> TokenLayout:
  """Maps each of `num_tokens` tokens to its request.

  Args:
    num_tokens: padded token count T (static).
    query_start_loc: `[S + 1]` int32 cumulative token counts; the tail repeats the total.
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.

  Returns:
    The `TokenLayout` of the batch.
  """
  num_requests = query_start_loc.shape[0] - 1
  qsl = query_start_loc.astype(jnp.int32)
  num_valid = jnp.clip(distribution[2].astype(jnp.int32), 0, num_requests)
  request_valid = jnp.arange(num_requests, dtype=jnp.int32) < num_valid
  query_lens = jnp.where(request_valid, qsl[1:] - qsl[:-1], 0)
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  # Token t belongs to the number of requests that end at or before it; an O(T * S) compare is tiny here.
  request_ids = jnp.sum(qsl[None, 1:] <= tokens[:, None], axis=1, dtype=jnp.int32)
  request_ids = jnp.minimum(request_ids, num_requests - 1)
  # Inside its request's range and the request is real; the precompile dummy (query_start_loc all ones,
  # distribution zeros) thus has no valid token.
  token_valid = request_valid[request_ids] & (qsl[request_ids] <= tokens) & (tokens < qsl[request_ids + 1])
  token_offsets = tokens - qsl[request_ids]
  return TokenLayout(
      request_ids=request_ids,
      token_valid=token_valid,
      token_offsets=token_offsets,
      query_lens=query_lens,
      request_valid=request_valid,
      num_valid_requests=num_valid,
  )


def check_state_metadata(
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    where: str,
    read_state_indices: jax.Array | None = None,
) -> int:
  """Checks the per-request arrays of a recurrent-state kernel; returns S.

  Raises:
    ValueError: `state_indices` / `seq_lens` / `read_state_indices` are not `[S]`, or the ragged batch shapes
      disagree.
  """
  if state_indices.ndim != 1:
    raise ValueError(f"{where}: state_indices must be [S]; got shape {state_indices.shape}")
  num_requests = state_indices.shape[0]
  if seq_lens.shape != (num_requests,):
    raise ValueError(f"{where}: seq_lens must be [S] = ({num_requests},) like state_indices; got {seq_lens.shape}")
  if read_state_indices is not None and read_state_indices.shape != (num_requests,):
    raise ValueError(
        f"{where}: read_state_indices must be [S] = ({num_requests},) like state_indices; got {read_state_indices.shape}"
    )
  check_ragged_metadata(num_requests, query_start_loc, distribution, where)
  return num_requests


def has_initial_state(layout: TokenLayout, seq_lens: jax.Array, read_state_indices: jax.Array | None = None) -> jax.Array:
  """`[S]` bool: the request is real, has tokens before this step and reads a real state slot.

  That is `seq_lens - query_lens > 0` and, when `read_state_indices` is given, `read_state_indices != 0`: a request
  whose read slot is the null slot 0 restored nothing (prefix caching resumes only from a restored state), so it
  starts from zeros. Requests without an initial state read their recurrent state as zeros, whatever their slot
  holds.
  """
  has_state = layout.request_valid & (seq_lens.astype(jnp.int32) - layout.query_lens > 0)
  if read_state_indices is not None:
    has_state = has_state & (read_state_indices.astype(jnp.int32) != NULL_STATE_SLOT)
  return has_state


def set_rows(target: jax.Array, index: jax.Array, updates: jax.Array) -> jax.Array:
  """`target.at[index].set(updates, mode="drop")`: rows `index[i]` of `target` become `updates[i]`, in place.

  Out-of-range entries of `index` write nothing. XLA rewrites a one-row dropping scatter as a select around a
  dynamic-update-slice, which copies all of `target`; for one row a second, always dropped row (zeros) is added,
  which keeps it a scatter that updates a donated `target` in place.

  Args:
    target: `[N, ...]`.
    index: `[n]` int rows.
    updates: `[n, ...]` matching `target`'s trailing axes.
  """
  if index.shape[0] == 1:
    index = jnp.concatenate([index, jnp.full((1,), target.shape[0], index.dtype)])
    updates = jnp.pad(updates, ((0, 1),) + ((0, 0),) * (updates.ndim - 1))
  return target.at[index].set(updates, mode="drop")


def materialize(values: Any, anchor: jax.Array) -> Any:
  """`values` (a pytree of arrays), computed once into buffers of their own before any op that reads them.

  XLA on CPU fuses cheap producers into their consumers and recomputes them for every element the consumer
  writes; for index arithmetic on `[S]` / `[T]` metadata vectors feeding a loop over large states that is dozens of
  ops per element. `jax.lax.optimization_barrier` did not stop that here; a conditional does, if XLA cannot fold
  it: `values` pass through one whose predicate is `anchor`'s first element `>= 0` (a count or an index in valid
  metadata), and whose other branch returns zeros (identical branches are folded away).

  Args:
    values: a pytree of arrays (small ones: the point is to compute them once).
    anchor: a traced integer array whose first element is >= 0 (e.g. `request_distribution`).

  Returns:
    `values`; zeros of the same shapes when `anchor[0] < 0`.
  """
  keep = jnp.ravel(anchor)[0] >= 0
  return jax.lax.cond(keep, lambda v: v, lambda v: jax.tree_util.tree_map(jnp.zeros_like, v), values)


def ragged_state_scan(
    update: Callable[[jax.Array, tuple], tuple[jax.Array, jax.Array]],
    per_token: tuple,
    states: jax.Array,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs a per-token recurrence over a ragged batch, each request continuing from its state slot.

  A request's first token starts from its read slot's state (`read_state_indices`, else `state_indices`) when it
  has an initial state (`has_initial_state`), else from zeros; every token applies `update(state, xs_t)`, which
  returns `(new state, output row)`; the state after a request's last token is written to its `state_indices`
  slot. Padding tokens (beyond `query_start_loc[distribution[2]]`) output zeros and write nothing. When no request
  has more than one new token (a batch of decodes), the tokens update at once (`vmap` of `update`) instead of in a
  `lax.scan` over the tokens; which way runs is decided on the device (`lax.cond`), the results are the same.

  Args:
    update: `(state [*S], per-token inputs of one token) -> (state, out)`, traced under `vmap` and in `lax.scan`.
    per_token: arrays with a leading token axis `[T, ...]`.
    states: `[M, *S]` fp32 state slots.
    state_indices, query_start_loc, seq_lens, distribution, read_state_indices: the ragged metadata.

  Returns:
    `([T, ...] outputs, [M, *S] updated states)`.
  """
  num_tokens = per_token[0].shape[0]
  num_slots = states.shape[0]
  state_indices = state_indices.astype(jnp.int32)
  layout = token_layout(num_tokens, query_start_loc, distribution)
  read = state_indices if read_state_indices is None else read_state_indices.astype(jnp.int32)
  has_init = has_initial_state(layout, seq_lens, read_state_indices)
  request_ids = layout.request_ids
  is_first = layout.token_offsets == 0
  is_last = layout.token_offsets == layout.query_lens[request_ids] - 1
  write_slot = jnp.where(layout.token_valid & is_last, state_indices[request_ids], num_slots)  # out of range: none
  # The index arithmetic above is a few ops on [S] / [T] vectors. Left to itself, XLA fuses it into the loops over
  # the states that use it and recomputes it for every state element, a cost that grows with the state's size;
  # materialized, it runs once, before them.
  has_init, read, request_ids, is_first, write_slot, token_valid = materialize(
      (has_init, read, request_ids, is_first, write_slot, layout.token_valid), distribution
  )
  write_slot = jnp.where(token_valid, write_slot, num_slots)  # malformed metadata (zeros from materialize): none

  def initial_states(requests):  # [len(requests), *S]: the requests' states before this step, zeros when none
    keep = has_init[requests].reshape((-1,) + (1,) * (states.ndim - 1))
    return jnp.where(keep, states[read[requests]], 0.0)

  def mask_rows(out):
    return jnp.where(token_valid.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0.0)

  def one_token_per_request(states):
    # Every token is its request's first and last: all of them update at once from their initial states, read
    # straight from the slots (T rows, not one per request row).
    token_states, out = jax.vmap(update)(initial_states(request_ids), per_token)
    return mask_rows(out), set_rows(states, write_slot, token_states)

  def scan_tokens(states):
    init_states = initial_states(jnp.arange(has_init.shape[0]))  # [S, *S]

    def step(carry, xs):
      state, slots = carry
      token_xs, request, first, slot, valid = xs
      state = jnp.where(first, init_states[request], state)
      state, out = update(state, token_xs)
      slots = slots.at[slot].set(state, mode="drop")
      return (state, slots), jnp.where(valid, out, 0.0)

    carry = (jnp.zeros(states.shape[1:], jnp.float32), states)
    xs = (per_token, request_ids, is_first, write_slot, token_valid)
    (_, new_states), out = jax.lax.scan(step, carry, xs)
    return out, new_states

  if num_tokens == 1:
    return one_token_per_request(states)
  # A batch of decodes (every request has at most one new token) needs no loop over its tokens.
  return jax.lax.cond(jnp.all(layout.query_lens <= 1), one_token_per_request, scan_tokens, states)


def align_state_indices(
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    distribution: jax.Array,
    mamba_block_size: int,
    num_slots: int,
) -> tuple[jax.Array, jax.Array]:
  """Read and write state slots of every request from its recurrent group's block table (the "align" scheme).

  Under prefix caching a request's recurrent state is checkpointed in state blocks, one per `mamba_block_size`
  tokens, named by the recurrent group's block table. A step reads the initial state from the block of its last
  computed token and writes the final state into the block of its last new token, as tpu-inference derives them:
  read = `table[r, max(num_computed - 1, 0) // mamba_block_size]`, write = `table[r, max(seq_len - 1, 0) //
  mamba_block_size]`, both clipped to `[0, num_slots)`. Padded request rows get the null slot 0.

  Args:
    block_tables: `[S * P]` flat block table of the recurrent group, row-major per request.
    seq_lens: `[S]` tokens per request after the step.
    query_start_loc: `[S + 1]`.
    distribution: `[3]`.
    mamba_block_size: tokens per state block (static).
    num_slots: rows M of the state arrays (static).

  Returns:
    `(read_state_indices [S], write_state_indices [S])` int32.

  Raises:
    ValueError: inconsistent shapes or a non-positive block size (static checks).
  """
  num_requests = seq_lens.shape[0]
  where = "align_state_indices"
  if mamba_block_size < 1:
    raise ValueError(f"{where}: mamba_block_size must be >= 1; got {mamba_block_size}")
  if block_tables.ndim != 1 or block_tables.shape[0] == 0 or block_tables.shape[0] % num_requests:
    raise ValueError(f"{where}: block_tables must be flat [S * P] with S = {num_requests}; got {block_tables.shape}")
  check_ragged_metadata(num_requests, query_start_loc, distribution, where)
  table = block_tables.astype(jnp.int32).reshape(num_requests, -1)
  layout = token_layout(1, query_start_loc, distribution)
  seq = seq_lens.astype(jnp.int32)
  computed = seq - layout.query_lens
  cols = table.shape[1]
  read_col = jnp.clip(jnp.maximum(computed - 1, 0) // mamba_block_size, 0, cols - 1)
  write_col = jnp.clip(jnp.maximum(seq - 1, 0) // mamba_block_size, 0, cols - 1)
  rows = jnp.arange(num_requests)
  read = jnp.where(layout.request_valid, jnp.clip(table[rows, read_col], 0, num_slots - 1), NULL_STATE_SLOT)
  write = jnp.where(layout.request_valid, jnp.clip(table[rows, write_col], 0, num_slots - 1), NULL_STATE_SLOT)
  return read.astype(jnp.int32), write.astype(jnp.int32)
