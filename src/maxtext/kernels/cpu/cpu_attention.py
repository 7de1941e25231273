"""Ragged paged attention over a float32 KV cache by the CPU kernel library (`cpu/paged_attention.cc`).

The pure-JAX attention (`ragged_paged_attention._attend`) gathers every page of each request's block table and
scores all of those positions before masking; in a decode step of a few tokens those gathers and small fused
products cost more than the weights' matrix-vector products of the layer. The kernel reads, in place, only the
cache rows of the keys each token sees, and computes the same softmax attention (scores, soft cap, sinks, sliding
window) in float32. The `cpu` kernel backend (`backend.CpuBackend`) attends by `attend` when `applies` says so:
float32 queries and caches with the default mask value, the kernel library loaded. The KV write stays in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.kv_cache import kv_cache_layout
from maxtext.kernels.cpu import cpu_gemm


def applies(
    q_dtype: jnp.dtype,
    cache_dtype: jnp.dtype,
    *,
    mask_value: float | None,
    soft_cap: float | None,
    sliding_window: int | None,
) -> bool:
  """Whether the `cpu` backend should attend through the kernel.

  True for float32 queries and cache, the default mask value (masked keys then weigh exactly zero, which the
  kernel's skipping them reproduces), a positive soft cap and window when given, once `cpu_gemm.load()` has
  succeeded.
  """
  return (
      jnp.dtype(q_dtype) == jnp.float32
      and jnp.dtype(cache_dtype) == jnp.float32
      and mask_value is None
      and (soft_cap is None or soft_cap > 0)
      and (sliding_window is None or sliding_window >= 1)
      and cpu_gemm.load()
  )


def attend(
    q: jax.Array,
    cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """Each real token's attention over its request's keys in `cache` (which already holds this step's K/V).

  Token `t` of request `r` sits at position `p = kv_lens[r] - (r's token count) + (t's offset in r)` and sees key
  positions `[0, p]`, or `(p - sliding_window, p]`, read from pages `page_indices[r * P:(r + 1) * P]`. Rows of
  padding tokens (from `cu_q_lens[distribution[2]]` on) and of positions outside the request's pages are zero.
  This is `ragged_paged_attention`'s attention for the metadata the runner builds (`cu_q_lens` nondecreasing).

  Args:
    q: `[T, Hq, d]` float32 queries.
    cache: `[N, block_size, R, 1, dp]` float32 paged cache in `kv_cache_layout`'s layout for `num_kv_heads` and d.
    kv_lens: `[S]` int32 KV length per request after this step.
    page_indices: `[S * P]` int32 flat block table.
    cu_q_lens: `[S + 1]` int32 cumulative query lengths.
    distribution: `[3]` int32; `distribution[2]` is the number of real requests.
    num_kv_heads: Hkv; Hq must be a multiple of it.
    sm_scale: multiplies `q . k`.
    sliding_window: None, or the window (>= 1) of positions a query sees.
    soft_cap: None, or `cap` (> 0) in `cap * tanh(logit / cap)`.
    sinks: None, or `[Hq]` float32 per-head sink logits added to the softmax denominator.

  Returns:
    `[T, Hq, d]` float32.

  Raises:
    ValueError: an operand's shape or dtype does not fit, or an option is out of range.
  """
  if q.ndim != 3 or q.dtype != jnp.float32:
    raise ValueError(f"cpu paged attention: q must be float32 [T, Hq, d]; got {q.dtype} {q.shape}")
  num_tokens, num_q_heads, head_dim = q.shape
  if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, (int, np.integer)) or num_kv_heads < 1:
    raise ValueError(f"cpu paged attention: num_kv_heads must be a positive int; got {num_kv_heads!r}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"cpu paged attention: Hq ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
  expected = kv_cache_layout.get_kv_cache_shape(1, 1, num_kv_heads, head_dim, jnp.float32)[2:]
  if cache.dtype != jnp.float32 or cache.ndim != 5 or tuple(cache.shape[2:]) != expected:
    raise ValueError(
        f"cpu paged attention: the cache must be float32 [N, block_size, {', '.join(map(str, expected))}] for"
        f" {num_kv_heads} KV heads of dim {head_dim}; got {cache.dtype} {cache.shape}"
    )
  num_seqs = kv_lens.shape[0] if kv_lens.ndim == 1 else 0
  metadata = {"kv_lens": kv_lens, "page_indices": page_indices, "cu_q_lens": cu_q_lens, "distribution": distribution}
  for name, value in metadata.items():
    if value.ndim != 1 or value.dtype != jnp.int32:
      raise ValueError(f"cpu paged attention: {name} must be 1-D int32; got {value.dtype} {value.shape}")
  if (
      num_seqs < 1
      or cu_q_lens.shape[0] != num_seqs + 1
      or distribution.shape[0] != 3
      or page_indices.shape[0] % num_seqs
      or page_indices.shape[0] == 0
  ):
    raise ValueError(
        "cpu paged attention: needs kv_lens [S] (S >= 1), cu_q_lens [S + 1], page_indices [S * P] (P >= 1) and"
        f" distribution [3]; got {kv_lens.shape}, {cu_q_lens.shape}, {page_indices.shape} and {distribution.shape}"
    )
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"cpu paged attention: sliding_window must be >= 1 or None; got {sliding_window}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"cpu paged attention: soft_cap must be > 0 or None; got {soft_cap}")
  if sinks is None:
    sinks = jnp.zeros((0,), jnp.float32)
  elif sinks.shape != (num_q_heads,):
    raise ValueError(f"cpu paged attention: sinks must be [Hq] = [{num_q_heads}]; got {sinks.shape}")
  out = jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), jnp.float32)
  return jax.ffi.ffi_call(cpu_gemm.TARGETS["attention"][0], out)(
      q,
      cache,
      kv_lens,
      page_indices,
      cu_q_lens,
      distribution,
      sinks.astype(jnp.float32),
      sm_scale=np.float32(sm_scale),
      soft_cap=np.float32(soft_cap or 0.0),
      sliding_window=np.int64(sliding_window or 0),
      num_kv_heads=np.int64(num_kv_heads),
  )
