"""Ragged paged attention in pure JAX: the reference backend of the runner's attention op (docs/runner-contract.md).

One call serves a whole ragged batch (decodes, prefills and chunked prefills mixed): it writes the new K/V rows
into the paged cache, then every query attends causally over its request's cached tokens.

Approach (memory-bounded, static shapes): tokens are processed in blocks of `query_block_size` with `lax.map`
(each block vectorised with `vmap`). For one token, the P pages of its request are gathered from the cache
(`[P * block_size]` key/value rows), so the working set of a block is
`query_block_size * P * block_size * (cache row bytes)`, and the default block size keeps it under
`_GATHER_BUDGET_BYTES`. Reading every page of a request and masking beyond the query position keeps all shapes
static; the cost per token is that of attending over `P * block_size` keys, which is fine for the tiny models this
backend runs on CPU. A TPU backend replaces this function as a whole (same signature and cache layout).
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.kernels import kv_cache_layout
from maxtext.kernels import ragged_batch

# Upper bound on the pages gathered for one block of queries (bytes); sets the default `query_block_size`.
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


def _validate(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, num_kv_heads) -> int:
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
  if kv_cache.ndim != 5:
    raise ValueError(
        f"{where}: kv_cache must be rank 5 [num_blocks, block_size, R, pk, padded_head_dim]; "
        f"got shape {kv_cache.shape} {kv_cache.dtype} (a recurrent state passed to an attention layer?)"
    )
  expected = kv_cache_layout.get_kv_cache_shape(
      kv_cache.shape[0], kv_cache.shape[1], num_kv_heads, head_dim, kv_cache.dtype
  )
  if kv_cache.shape != expected:
    raise ValueError(
        f"{where}: a {kv_cache.dtype} cache for {num_kv_heads} KV heads of dim {head_dim} must have shape "
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


def default_query_block_size(num_tokens: int, kv_cache: jax.Array, pages_per_seq: int, num_q_heads: int) -> int:
  """Largest token block whose gathered pages and logits fit in `_GATHER_BUDGET_BYTES` (at least 1)."""
  _, block_size, rows, pk, padded_dim = kv_cache.shape
  keys = pages_per_seq * block_size
  # Cache rows in their dtype plus the fp32 K and V copies, plus fp32 logits and probabilities.
  per_token = keys * rows * pk * padded_dim * (kv_cache.dtype.itemsize + 8) + 2 * keys * num_q_heads * 4
  return int(max(1, min(num_tokens, _GATHER_BUDGET_BYTES // per_token)))


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
    query_block_size: tokens per vectorised block; defaults to the largest block within the gather budget.

  Returns:
    `(out [T, Hq, d] in q.dtype, new_kv_cache)`; `new_kv_cache` is `kv_cache` itself when not updating.

  Raises:
    ValueError / TypeError: inconsistent shapes or bad options (all checks are static).
  """
  _check_scalar(sm_scale, "sm_scale", integer=False, optional=False)
  _check_scalar(sliding_window, "sliding_window", integer=True)
  _check_scalar(soft_cap, "soft_cap", integer=False)
  _check_scalar(query_block_size, "query_block_size", integer=True)
  if update_kv_cache and k is None:
    raise ValueError("ragged_paged_attention: update_kv_cache=True needs k and v")
  num_kv_heads = _validate(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks, num_kv_heads)
  num_tokens, num_q_heads, head_dim = q.shape
  num_blocks, block_size = kv_cache.shape[:2]
  num_seqs = kv_lens.shape[0]
  pages_per_seq = page_indices.shape[0] // num_seqs
  max_kv_len = pages_per_seq * block_size
  group = num_q_heads // num_kv_heads
  if mask_value is None:
    mask_value = float(jnp.finfo(jnp.float32).min)
  if query_block_size is None:
    query_block_size = default_query_block_size(num_tokens, kv_cache, pages_per_seq, num_q_heads)

  page_indices = page_indices.astype(jnp.int32)
  layout = ragged_batch.token_layout(num_tokens, cu_q_lens, distribution)
  request_ids = layout.request_ids
  kv_len = kv_lens.astype(jnp.int32)[request_ids]
  positions = kv_len - layout.query_lens[request_ids] + layout.token_offsets  # [T] position of each new token
  # Malformed metadata (a position outside the request's pages) is treated like padding: no write, no read.
  active = layout.token_valid & (positions >= 0) & (positions < max_kv_len)

  new_cache = kv_cache
  if update_kv_cache:
    rows = kv_cache_layout.merge_kv(k, v, kv_cache.dtype)  # [T, R, pk, dp]
    page_slot = jnp.clip(positions // block_size, 0, pages_per_seq - 1)
    pages = page_indices[request_ids * pages_per_seq + page_slot]
    flat_rows = jnp.where(active, pages * block_size + positions % block_size, num_blocks * block_size)
    flat_cache = kv_cache.reshape(num_blocks * block_size, *kv_cache.shape[2:])
    if num_tokens == 1:
      # XLA rewrites a one-row dropping scatter as a select around a dynamic-update-slice, which copies the whole
      # cache; a second, always dropped row keeps it a scatter, which updates the donated cache in place.
      flat_rows = jnp.concatenate([flat_rows, jnp.full((1,), num_blocks * block_size, flat_rows.dtype)])
      rows = jnp.concatenate([rows, rows])
    new_cache = flat_cache.at[flat_rows].set(rows, mode="drop").reshape(kv_cache.shape)

  sink_logits = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)
  key_positions = jnp.arange(max_kv_len, dtype=jnp.int32)

  def attend_one(args):
    q_t, request, position, is_active = args  # q_t: [Hq, d]
    pages = jax.lax.dynamic_slice_in_dim(page_indices, request * pages_per_seq, pages_per_seq)
    gathered = new_cache[pages].reshape(max_kv_len, *kv_cache.shape[2:])
    keys, values = kv_cache_layout.read_kv(gathered, num_kv_heads, head_dim)  # [P * bs, Hkv, d]
    qg = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
    logits = jnp.einsum("hgd,lhd->hgl", qg, keys.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    keep = key_positions <= position
    if sliding_window is not None:
      keep &= position - key_positions < sliding_window
    logits = jnp.where(keep, logits, mask_value)
    row_max = jnp.max(logits, axis=-1)
    if sink_logits is not None:
      row_max = jnp.maximum(row_max, sink_logits)
    probs = jnp.exp(logits - row_max[..., None])
    denom = jnp.sum(probs, axis=-1)
    if sink_logits is not None:
      denom = denom + jnp.exp(sink_logits - row_max)
    out = jnp.einsum("hgl,lhd->hgd", probs, values.astype(jnp.float32)) / denom[..., None]
    out = jnp.where(is_active, out, 0.0)
    return out.reshape(num_q_heads, head_dim).astype(q.dtype)

  per_token = (q, request_ids, positions, active)
  if query_block_size >= num_tokens:
    out = jax.vmap(attend_one)(per_token)  # one block: no loop
  else:
    out = jax.lax.map(attend_one, per_token, batch_size=query_block_size)
  return out, new_cache
