"""Physical layout of the paged attention KV cache, as the TPU runner allocates it (docs/runner-contract.md).

One cache array per attention slot, rank 5, zero-filled by the runner:

* Standard layout: `[num_blocks, block_size, align(2 * Hkv, pk) / pk, pk, align(head_dim, 128)]`. K and V are
  interleaved per head: combined head `2h` is K of KV head h and `2h + 1` is V of KV head h. The combined-head
  axis is split into groups of `pk` rows so that sub-32-bit dtypes pack into 32-bit words.
* Head-dim-64 layout: `[num_blocks, block_size, align(Hkv, pk) / pk, pk, 128]`, the last axis holding
  `[K (64) | V (64)]` of one KV head.

`pk = 32 / bits` is the dtype packing: 1 for fp32, 2 for bf16/fp16, 4 for fp8/int8. Padding rows and columns are
zeros and are never read back as data.

Under tensor parallelism over `S` shards the runner shards the packed-head axis, and each shard holds the layout of
its own `Hkv / S` heads (`runner/kv_cache.py::get_kv_cache_shape_with_mesh`): the axis is `S` per-shard blocks of
rows, shard `s` holding KV heads `s * Hkv / S ...`, each block padded to whole groups of `pk` on its own. Where a
shard's heads do not fill whole groups (the head-dim-64 layout with an odd head count per shard in bf16), that is
more rows than the unsharded layout has; otherwise the two are the same array. `num_shards` selects it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# The lane width of the TPU vector unit: the head dim of the cache is padded to a multiple of it.
LANE_WIDTH = 128
# The head dim with its own cache layout (K and V of one head share one 128-lane row).
HD64_HEAD_DIM = 64


def _check_positive_int(value: int, name: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int; got {type(value).__name__} ({value!r})")
  if value <= 0:
    raise ValueError(f"{name} must be positive; got {value}")


def align_to(x: int, multiple: int) -> int:
  """Rounds `x` up to a multiple of `multiple`."""
  return -(-x // multiple) * multiple


def get_dtype_packing(dtype: DTypeLike) -> int:
  """Returns how many values of `dtype` pack into 32 bits: 1 for fp32, 2 for bf16, 4 for fp8/int8.

  Raises:
    ValueError: the dtype is not a float or integer type 8, 16 or 32 bits wide.
  """
  dt = jnp.dtype(dtype)
  # Sub-byte types (int4, fp4) occupy a whole byte in NumPy, so ask finfo/iinfo for the real width.
  if jnp.issubdtype(dt, jnp.floating):
    bits = jnp.finfo(dt).bits
  elif jnp.issubdtype(dt, jnp.integer):
    bits = jnp.iinfo(dt).bits
  else:
    raise ValueError(f"KV cache dtype must be a float or integer type; got {dt.name}")
  if bits not in (8, 16, 32):
    raise ValueError(f"KV cache dtype must be 8, 16 or 32 bits wide; got {dt.name} ({bits} bits)")
  return 32 // bits


def get_padded_head_dim(head_dim: int) -> int:
  """Head dim as stored in the cache: 64 stays 64 (its own layout), anything else rounds up to a multiple of 128."""
  _check_positive_int(head_dim, "head_dim")
  if head_dim == HD64_HEAD_DIM:
    return HD64_HEAD_DIM
  return align_to(head_dim, LANE_WIDTH)


def get_padded_num_heads(num_heads: int, sharding_size: int) -> int:
  """KV head count the runner allocates for `sharding_size` tensor-parallel shards.

  Fewer heads than shards are replicated up to `sharding_size`; otherwise the count must split evenly.

  Raises:
    ValueError: the heads cannot be spread evenly over the shards.
  """
  _check_positive_int(num_heads, "num_heads")
  _check_positive_int(sharding_size, "sharding_size")
  if num_heads >= sharding_size:
    if num_heads % sharding_size:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of the sharding size ({sharding_size})")
    return num_heads
  if sharding_size % num_heads:
    raise ValueError(f"the sharding size ({sharding_size}) must be a multiple of num_heads ({num_heads}) to replicate")
  return sharding_size


def uses_hd64_layout(head_dim: int) -> bool:
  """True when the cache uses the head-dim-64 layout (last axis `[K64 | V64]`)."""
  return get_padded_head_dim(head_dim) == HD64_HEAD_DIM


def _heads_per_shard(num_kv_heads: int, num_shards: int) -> int:
  _check_positive_int(num_kv_heads, "num_kv_heads")
  _check_positive_int(num_shards, "num_shards")
  if num_kv_heads % num_shards:
    raise ValueError(
        f"num_kv_heads ({num_kv_heads}) must be a multiple of num_shards ({num_shards}): each tensor-parallel shard"
        " holds whole heads"
    )
  return num_kv_heads // num_shards


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike, num_shards: int = 1
) -> tuple[int, int, int, int, int]:
  """Shape of one layer's paged KV cache (docs/runner-contract.md).

  Args:
    num_blocks: number of pages N.
    block_size: tokens per page.
    num_kv_heads: KV heads Hkv (already padded for tensor parallelism, see `get_padded_num_heads`).
    head_dim: the real head dim d (padding is applied here).
    dtype: cache dtype; sets the packing pk.
    num_shards: tensor-parallel shards S of the packed-head axis (the module docstring).

  Returns:
    `(N, block_size, S * align(2 Hkv / S, pk) / pk, pk, align(d, 128))`, or `(N, block_size, S * align(Hkv / S, pk)
    / pk, pk, 128)` when d == 64.

  Raises:
    ValueError: a non-positive size, or heads that do not split evenly over the shards.
  """
  _check_positive_int(num_blocks, "num_blocks")
  _check_positive_int(block_size, "block_size")
  heads = _heads_per_shard(num_kv_heads, num_shards)
  pk = get_dtype_packing(dtype)
  if uses_hd64_layout(head_dim):
    return (num_blocks, block_size, num_shards * (align_to(heads, pk) // pk), pk, 2 * HD64_HEAD_DIM)
  return (num_blocks, block_size, num_shards * (align_to(2 * heads, pk) // pk), pk, get_padded_head_dim(head_dim))


def merge_kv(k: jax.Array, v: jax.Array, dtype: DTypeLike, num_shards: int = 1) -> jax.Array:
  """Packs K and V rows into cache rows.

  Args:
    k: `[..., H, d]` keys.
    v: `[..., H, d]` values.
    dtype: cache dtype (the result is cast to it).
    num_shards: tensor-parallel shards S: each shard's `H / S` heads are packed on their own (module docstring).

  Returns:
    `[..., S * align(2H / S, pk) / pk, pk, align(d, 128)]`, or `[..., S * align(H / S, pk) / pk, pk, 128]` when
    d == 64; padding is zero.

  Raises:
    ValueError: k and v differ in shape or have rank < 2, or H does not split over the shards.
  """
  if k.shape != v.shape or k.ndim < 2:
    raise ValueError(f"merge_kv needs k and v of one shape [..., H, d]; got k {k.shape} and v {v.shape}")
  *lead, num_heads, head_dim = k.shape
  heads = _heads_per_shard(num_heads, num_shards)
  if num_shards > 1:
    # Each shard's heads packed alone, the shards' rows one after another.
    split = (*lead, num_shards, heads, head_dim)
    rows = merge_kv(k.reshape(split), v.reshape(split), dtype)  # [..., S, R / S, pk, dp]
    return rows.reshape(*lead, num_shards * rows.shape[-3], *rows.shape[-2:])
  pk = get_dtype_packing(dtype)
  k = k.astype(dtype)
  v = v.astype(dtype)
  no_pad = [(0, 0)] * len(lead)
  if uses_hd64_layout(head_dim):
    kv = jnp.concatenate([k, v], axis=-1)  # [..., H, 128]
    rows = align_to(num_heads, pk)
    kv = jnp.pad(kv, no_pad + [(0, rows - num_heads), (0, 0)])
    return kv.reshape(*lead, rows // pk, pk, 2 * HD64_HEAD_DIM)
  padded_dim = get_padded_head_dim(head_dim)
  kv = jnp.stack([k, v], axis=-2).reshape(*lead, 2 * num_heads, head_dim)  # K_h, V_h interleaved
  rows = align_to(2 * num_heads, pk)
  kv = jnp.pad(kv, no_pad + [(0, rows - 2 * num_heads), (0, padded_dim - head_dim)])
  return kv.reshape(*lead, rows // pk, pk, padded_dim)


def read_kv(rows: jax.Array, num_kv_heads: int, head_dim: int, num_shards: int = 1) -> tuple[jax.Array, jax.Array]:
  """Unpacks cache rows into K and V (the inverse of `merge_kv`), in the cache dtype.

  Args:
    rows: `[..., R, pk, dp]` cache rows, e.g. a whole cache `[N, bs, R, pk, dp]` or gathered pages.
    num_kv_heads: the real KV head count H.
    head_dim: the real head dim d.
    num_shards: tensor-parallel shards S the rows were packed for (`merge_kv`).

  Returns:
    `(k, v)`, each `[..., H, d]`.

  Raises:
    ValueError: the trailing axes do not hold `num_kv_heads` heads of `head_dim` over `num_shards` shards.
  """
  expected = get_kv_cache_shape(1, 1, num_kv_heads, head_dim, rows.dtype, num_shards)[2:]
  if rows.ndim < 3 or tuple(rows.shape[-3:]) != expected:
    raise ValueError(
        f"cache rows for {num_kv_heads} KV heads of dim {head_dim} in {rows.dtype} over {num_shards} shard(s) must"
        f" end in {expected}; got shape {rows.shape}"
    )
  lead = rows.shape[:-3]
  if num_shards > 1:
    per_shard = rows.reshape(*lead, num_shards, expected[0] // num_shards, *expected[1:])
    k, v = read_kv(per_shard, num_kv_heads // num_shards, head_dim)  # [..., S, H / S, d]
    return k.reshape(*lead, num_kv_heads, head_dim), v.reshape(*lead, num_kv_heads, head_dim)
  flat = rows.reshape(*lead, expected[0] * expected[1], expected[2])
  if uses_hd64_layout(head_dim):
    kv = flat[..., :num_kv_heads, :]
    return kv[..., :HD64_HEAD_DIM], kv[..., HD64_HEAD_DIM:]
  kv = flat[..., : 2 * num_kv_heads, :head_dim].reshape(*lead, num_kv_heads, 2, head_dim)
  return kv[..., 0, :], kv[..., 1, :]
