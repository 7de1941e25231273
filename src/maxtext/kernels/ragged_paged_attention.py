"""Ragged paged attention in pure JAX: the reference backend of the runner's attention op (docs/runner-contract.md).

One call serves a whole ragged batch (decodes, prefills and chunked prefills mixed): it writes the new K/V rows
into the paged cache, then every query attends causally over its request's cached tokens.

Approach (static shapes, one page gather per block of queries): each request's new tokens are cut into work items
of `query_block_size` consecutive queries, and an item gathers its request's P pages once (`[P * block_size]` key
/ value rows) for all its queries. A batch of T tokens over S request rows has at most `min(T, ceil(T / Bq) + S)`
items, a static count; the items past the real ones are padding. The default block follows the batch's shape:
1 for a batch of decodes (one token per request), up to 64 for prefills, so a prefill gathers each page once per
64 queries instead of once per query. Scores and weighted sums are written as broadcast products reduced over
the head dim and the keys, which XLA on CPU fuses with the gather instead of transposing the gathered rows for a
batched matmul. Items run vectorised, in batches that keep the gathered pages and scores of a batch under
`_GATHER_BUDGET_BYTES`. Reading every page of a request and masking beyond the query position keeps all shapes
static; the cost of a query is that of attending over `P * block_size` keys, fine for the models this backend
runs on CPU. Another backend replaces this function as a whole (same signature and cache layout), or keeps its
K/V write (`write_kv`) and attends over the written cache its own way.
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.kv_cache import kv_cache_layout
from maxtext.kernels import ragged_batch

# Upper bound on the gathered pages and scores of the work items vectorised together (bytes); sets `items_per_batch`.
_GATHER_BUDGET_BYTES = 64 * 1024 * 1024


def _check_scalar(value: float | int | None, name: str, *, integer: bool, optional: bool = True) -> None:
  """Static option check: `value` is a Python number (positive when optional), or None when optional."""
  if value is None and optional:
    return
  kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, bool) or not isinstance(value, kinds):
    kind = "an int" if integer else "a float"
    raise TypeError(f"ragged_paged_attention: {name} must be {kind}{' or None' if optional else ''}; got {value!r}")
  if optional and value <= 0:
    raise ValueError(f"ragged_paged_attention: {name} must be positive when set; got {value}")


def _validate(  # pylint: disable=too-many-positional-arguments
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, num_kv_heads, num_kv_shards
) -> int:
  """Checks static shapes; returns the KV head count."""
  where = "ragged_paged_attention"
  if q.ndim != 3:
    raise ValueError(f"{where}: q must be [T, Hq, d]; got shape {q.shape}")
  num_tokens, num_q_heads, head_dim = q.shape
  if (k is None) != (v is None):
    raise ValueError(f"{where}: pass both k and v or neither; got k {k is not None} and v {v is not None}")
  if k is None:
    if num_kv_heads is None:
      raise ValueError(f"{where}: num_kv_heads is required when k and v are None (update_kv_cache=False)")
  else:
    if k.ndim != 3 or k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
      raise ValueError(
          f"{where}: k and v must both be [T, Hkv, d] = [{num_tokens}, Hkv, {head_dim}] like q {q.shape}; "
          f"got k {k.shape} and v {v.shape}"
      )
    if num_kv_heads is not None and num_kv_heads != k.shape[1]:
      raise ValueError(f"{where}: num_kv_heads={num_kv_heads} disagrees with k {k.shape}")
    num_kv_heads = k.shape[1]
  if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
    raise ValueError(f"{where}: Hq ({num_q_heads}) must be a positive multiple of Hkv ({num_kv_heads}) for GQA")
  if isinstance(num_kv_shards, bool) or not isinstance(num_kv_shards, int) or num_kv_shards < 1:
    raise ValueError(f"{where}: num_kv_shards must be an int >= 1; got {num_kv_shards!r}")
  if num_kv_heads % num_kv_shards:
    raise ValueError(f"{where}: Hkv ({num_kv_heads}) must be a multiple of num_kv_shards ({num_kv_shards})")
  if kv_cache.ndim != 5:
    raise ValueError(
        f"{where}: kv_cache must be rank 5 [num_blocks, block_size, R, pk, padded_head_dim]; "
        f"got shape {kv_cache.shape} {kv_cache.dtype} (a recurrent state passed to an attention layer?)"
    )
  expected = kv_cache_layout.get_kv_cache_shape(
      kv_cache.shape[0], kv_cache.shape[1], num_kv_heads, head_dim, kv_cache.dtype, num_kv_shards
  )
  if kv_cache.shape != expected:
    shards = f" over {num_kv_shards} shards" if num_kv_shards > 1 else ""
    raise ValueError(
        f"{where}: a {kv_cache.dtype} cache for {num_kv_heads} KV heads of dim {head_dim}{shards} must have shape "
        f"{expected}; got {kv_cache.shape}"
    )
  if kv_lens.ndim != 1:
    raise ValueError(f"{where}: kv_lens must be [S]; got shape {kv_lens.shape}")
  num_seqs = kv_lens.shape[0]
  ragged_batch.check_ragged_metadata(num_seqs, cu_q_lens, distribution, where)
  if page_indices.ndim != 1 or page_indices.shape[0] == 0 or page_indices.shape[0] % num_seqs:
    raise ValueError(
        f"{where}: page_indices must be a flat [S * P] table with P >= 1 pages per sequence (S = {num_seqs}); "
        f"got shape {page_indices.shape}"
    )
  if sinks is not None and sinks.shape != (num_q_heads,):
    raise ValueError(f"{where}: sinks must have shape (Hq,) = ({num_q_heads},); got {sinks.shape}")
  return num_kv_heads


# The largest default query block: past it, padding queries in partial blocks cost more than the gathers saved.
_MAX_DEFAULT_QUERY_BLOCK = 64


def default_query_block_size(num_tokens: int, num_seqs: int) -> int:
  """Queries per work item: the power of two at or above the mean tokens per request row, within [1, 64].

  A batch of decodes (T <= S) gets 1, so no item carries padding queries; a prefill of T tokens over a few
  requests gets large blocks, so each gathers its pages for many queries.
  """
  mean = -(-num_tokens // max(1, num_seqs))
  return min(_MAX_DEFAULT_QUERY_BLOCK, 1 << max(0, mean - 1).bit_length())


def num_work_items(num_tokens: int, num_seqs: int, query_block_size: int) -> int:
  """Static count of work items: a request of `ql` tokens takes `ceil(ql / Bq)` of them, each at least one token."""
  if query_block_size == 1:
    return num_tokens
  return min(num_tokens, -(-num_tokens // query_block_size) + num_seqs)


def items_per_batch(kv_cache: jax.Array, pages_per_seq: int, num_q_heads: int, query_block_size: int) -> int:
  """Work items vectorised together: as many as keep their gathered pages and scores under the budget (>= 1)."""
  _, block_size, rows, pk, padded_dim = kv_cache.shape
  keys = pages_per_seq * block_size
  # Cache rows in their dtype plus the fp32 K and V copies, plus fp32 scores and probabilities of each query.
  per_item = keys * rows * pk * padded_dim * (kv_cache.dtype.itemsize + 8) + 2 * query_block_size * keys * num_q_heads * 4
  return int(max(1, _GATHER_BUDGET_BYTES // per_item))


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array | None,
    v: jax.Array | None,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    update_kv_cache: bool = True,
    mask_value: float | None = None,
    num_kv_heads: int | None = None,
    num_kv_shards: int = 1,
    query_block_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Writes the batch's new K/V into the paged cache and attends each query over its request's tokens.

  Request i (for `i < distribution[2]`) owns tokens `[cu_q_lens[i], cu_q_lens[i + 1])`, `ql` of them, and has
  `L = kv_lens[i]` tokens after this step; its new token j sits at position `p = L - ql + j`, stored in page
  `page_indices[i * P + p // block_size]`, row `p % block_size`. Query j attends to positions `[0, p]` (and only
  `p - key < sliding_window` when a window is set). Padded tokens (from `cu_q_lens[distribution[2]]` on) and
  padded requests neither write nor read: their output rows are zero and the cache rows their (zero) page
  entries point at, page 0 included, are untouched.

  Args:
    q: `[T, Hq, d]` queries (the output has their dtype).
    k: `[T, Hkv, d]` new keys, or None when `update_kv_cache` is False (then pass `num_kv_heads`).
    v: `[T, Hkv, d]` new values, or None like `k`.
    kv_cache: `[N, block_size, R, pk, dp]` paged cache (`kv_cache_layout.get_kv_cache_shape`).
    kv_lens: `[S]` int32 KV length per request after this step (`seq_lens`).
    page_indices: `[S * P]` int32 flat block table, row-major per request; unused entries may be 0.
    cu_q_lens: `[S + 1]` int32 cumulative query lengths (`query_start_loc`).
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    sm_scale: multiplies `q . k` (pass 1.0 when q is pre-scaled).
    sliding_window: keep key positions with `query_pos - key_pos < sliding_window`; None for full attention.
    soft_cap: `cap * tanh(logit / cap)` after scaling, before masking; None to disable.
    sinks: `[Hq]` fp32 per-head sink logits: each adds `exp(sink)` to its head's softmax denominator (unscaled).
    update_kv_cache: write k/v into the cache first; False reads the cache as given (KV-sharing layers).
    mask_value: logit of masked keys; defaults to the fp32 minimum (logits are fp32).
    num_kv_heads: Hkv when k/v are None; must match k when both are given.
    num_kv_shards: tensor-parallel shards the cache's packed-head axis is laid out for
      (`kv_cache_layout.get_kv_cache_shape`).
    query_block_size: queries per work item (each gathers its request's pages once); defaults to
      `default_query_block_size(T, S)`.

  Returns:
    `(out [T, Hq, d] in q.dtype, new_kv_cache)`; `new_kv_cache` is `kv_cache` itself when not updating.

  Raises:
    ValueError / TypeError: inconsistent shapes or bad options (all checks are static).
  """
  _check_scalar(sm_scale, "sm_scale", integer=False, optional=False)
  _check_scalar(sliding_window, "sliding_window", integer=True)
  _check_scalar(soft_cap, "soft_cap", integer=False)
  _check_scalar(query_block_size, "query_block_size", integer=True)
  new_cache, num_kv_heads = write_kv(
      q,
      k,
      v,
      kv_cache,
      kv_lens,
      page_indices,
      cu_q_lens,
      distribution,
      sinks=sinks,
      update_kv_cache=update_kv_cache,
      num_kv_heads=num_kv_heads,
      num_kv_shards=num_kv_shards,
  )
  num_tokens, num_seqs = q.shape[0], kv_lens.shape[0]
  if query_block_size is None:
    query_block_size = default_query_block_size(num_tokens, num_seqs)
  layout = ragged_batch.token_layout(num_tokens, cu_q_lens, distribution)
  if mask_value is None:
    mask_value = float(jnp.finfo(jnp.float32).min)
  out = _attend(
      q,
      new_cache,
      kv_lens.astype(jnp.int32),
      page_indices.astype(jnp.int32),
      cu_q_lens.astype(jnp.int32),
      layout,
      num_kv_heads=num_kv_heads,
      num_kv_shards=num_kv_shards,
      sm_scale=sm_scale,
      sliding_window=sliding_window,
      soft_cap=soft_cap,
      sinks=sinks,
      mask_value=mask_value,
      query_block_size=query_block_size,
  )
  return out, new_cache


def write_kv(
    q: jax.Array,
    k: jax.Array | None,
    v: jax.Array | None,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sinks: jax.Array | None = None,
    update_kv_cache: bool = True,
    num_kv_heads: int | None = None,
    num_kv_shards: int = 1,
) -> tuple[jax.Array, int]:
  """Checks `ragged_paged_attention`'s operands and writes the batch's new K/V into the paged cache.

  The first half of `ragged_paged_attention` (same arguments and checks): a backend with its own attention over the
  written cache calls it, then attends.

  Returns:
    `(new_kv_cache, Hkv)`; `new_kv_cache` is `kv_cache` itself when not updating.

  Raises:
    ValueError / TypeError: inconsistent shapes (all checks are static).
  """
  if update_kv_cache and k is None:
    raise ValueError("ragged_paged_attention: update_kv_cache=True needs k and v")
  num_kv_heads = _validate(
      q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, num_kv_heads, num_kv_shards
  )
  if not update_kv_cache:
    return kv_cache, num_kv_heads
  num_tokens = q.shape[0]
  num_blocks, block_size = kv_cache.shape[:2]
  num_seqs = kv_lens.shape[0]
  pages_per_seq = page_indices.shape[0] // num_seqs
  max_kv_len = pages_per_seq * block_size
  page_indices = page_indices.astype(jnp.int32)
  layout = ragged_batch.token_layout(num_tokens, cu_q_lens, distribution)
  request_ids = layout.request_ids
  kv_len = kv_lens.astype(jnp.int32)[request_ids]
  positions = kv_len - layout.query_lens[request_ids] + layout.token_offsets  # [T] position of each new token
  # Malformed metadata (a position outside the request's pages) is treated like padding: no write.
  active = layout.token_valid & (positions >= 0) & (positions < max_kv_len)
  rows = kv_cache_layout.merge_kv(k, v, kv_cache.dtype, num_kv_shards)  # [T, R, pk, dp]
  page_slot = jnp.clip(positions // block_size, 0, pages_per_seq - 1)
  pages = page_indices[request_ids * pages_per_seq + page_slot]
  flat_rows = jnp.where(active, pages * block_size + positions % block_size, num_blocks * block_size)
  flat_cache = kv_cache.reshape(num_blocks * block_size, *kv_cache.shape[2:])
  return ragged_batch.set_rows(flat_cache, flat_rows, rows).reshape(kv_cache.shape), num_kv_heads


def _attend(
    q: jax.Array,
    cache: jax.Array,
    kv_len: jax.Array,
    page_indices: jax.Array,
    query_start_loc: jax.Array,
    layout: ragged_batch.TokenLayout,
    *,
    num_kv_heads: int,
    num_kv_shards: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None,
    mask_value: float,
    query_block_size: int,
) -> jax.Array:
  """Attention of every real query over its request's pages of `cache` (already holding this step's K/V).

  Args:
    q: `[T, Hq, d]`.
    cache: `[N, bs, R, pk, dp]`.
    kv_len: `[S]` int32 KV length per request after this step.
    page_indices: `[S * P]` int32.
    query_start_loc: `[S + 1]` int32.
    layout: the batch's `TokenLayout`.
    num_kv_heads, num_kv_shards, sm_scale, sliding_window, soft_cap, sinks, mask_value: as in
      `ragged_paged_attention`.
    query_block_size: queries per work item Bq.

  Returns:
    `[T, Hq, d]` in q's dtype; rows of padding tokens (and of malformed positions) are zero.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  num_seqs = kv_len.shape[0]
  pages_per_seq = page_indices.shape[0] // num_seqs
  block_size = cache.shape[1]
  max_kv_len = pages_per_seq * block_size
  group = num_q_heads // num_kv_heads
  qb = query_block_size

  # Work item i is block `item_block` of request `item_request`: request-local queries [item_block * Bq, + Bq).
  blocks = (layout.query_lens + qb - 1) // qb  # [S], 0 for padded requests
  ends = jnp.cumsum(blocks)
  num_items = num_work_items(num_tokens, num_seqs, qb)
  items = jnp.arange(num_items, dtype=jnp.int32)
  item_request = jnp.minimum(jnp.sum(ends[None, :] <= items[:, None], axis=1, dtype=jnp.int32), num_seqs - 1)
  item_block = items - (ends - blocks)[item_request]
  item_valid = items < ends[-1]
  item_start = query_start_loc[item_request] + item_block * qb  # batch index of the item's first query

  # Padding rows at the end so that every item's slice of Bq queries lies inside the array.
  q_padded = jnp.pad(q, ((0, qb), (0, 0), (0, 0)))
  key_positions = jnp.arange(max_kv_len, dtype=jnp.int32)
  offsets = jnp.arange(qb, dtype=jnp.int32)
  sink_logits = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)

  def attend_item(args):
    request, block, start, valid = args
    local = block * qb + offsets  # [Bq] request-local query index
    query_len = layout.query_lens[request]
    positions = kv_len[request] - query_len + local
    # Malformed metadata (a position outside the request's pages) is treated like padding: no read.
    row_valid = valid & (local < query_len) & (positions >= 0) & (positions < max_kv_len)
    q_rows = jax.lax.dynamic_slice_in_dim(q_padded, start, qb).astype(jnp.float32)
    q_rows = q_rows.reshape(qb, 1, num_kv_heads, group, head_dim)
    pages = jax.lax.dynamic_slice_in_dim(page_indices, request * pages_per_seq, pages_per_seq)
    gathered = cache[pages].reshape(max_kv_len, *cache.shape[2:])
    keys, values = kv_cache_layout.read_kv(gathered, num_kv_heads, head_dim, num_kv_shards)  # [L, Hkv, d]
    # Scores [Bq, L, Hkv, G]: a product reduced over d, fused with the gather (no transposed copy of the keys).
    logits = jnp.sum(q_rows * keys.astype(jnp.float32)[None, :, :, None, :], axis=-1) * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    keep = key_positions[None, :] <= positions[:, None]  # [Bq, L]
    if sliding_window is not None:
      keep &= positions[:, None] - key_positions[None, :] < sliding_window
    logits = jnp.where(keep[:, :, None, None], logits, mask_value)
    row_max = jnp.max(logits, axis=1)  # [Bq, Hkv, G]
    if sink_logits is not None:
      row_max = jnp.maximum(row_max, sink_logits)
    probs = jnp.exp(logits - row_max[:, None])
    denom = jnp.sum(probs, axis=1)
    if sink_logits is not None:
      denom = denom + jnp.exp(sink_logits - row_max)
    weighted = jnp.sum(probs[..., None] * values.astype(jnp.float32)[None, :, :, None, :], axis=1)  # [Bq, Hkv, G, d]
    out = jnp.where(row_valid[:, None, None, None], weighted / denom[..., None], 0.0)
    rows = jnp.where(row_valid, start + offsets, num_tokens + qb)  # out of range: dropped
    return out.reshape(qb, num_q_heads, head_dim).astype(q.dtype), rows

  per_item = (item_request, item_block, item_start, item_valid)
  batch = items_per_batch(cache, pages_per_seq, num_q_heads, qb)
  if batch >= num_items:
    outs, rows = jax.vmap(attend_item)(per_item)  # one batch: no loop
  else:
    outs, rows = jax.lax.map(attend_item, per_item, batch_size=batch)
  out = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
  return out.at[rows.reshape(-1)].set(outs.reshape(-1, num_q_heads, head_dim), mode="drop")
