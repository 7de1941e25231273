"""Tests for the paged KV cache layout against a loop-based NumPy packer written here."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kv_cache import kv_cache_layout


def _np_pack(k: np.ndarray, v: np.ndarray, dtype) -> np.ndarray:
  """Packs `[T, H, d]` K/V into cache rows by the contract's rules, one head at a time."""
  num_tokens, num_heads, head_dim = k.shape
  pk = 4 // np.dtype(dtype).itemsize
  if head_dim == 64:
    rows = -(-num_heads // pk)
    out = np.zeros((num_tokens, rows, pk, 128))
    for h in range(num_heads):
      out[:, h // pk, h % pk, :64] = k[:, h]
      out[:, h // pk, h % pk, 64:] = v[:, h]
    return out.astype(dtype)
  rows = -(-(2 * num_heads) // pk)
  out = np.zeros((num_tokens, rows, pk, -(-head_dim // 128) * 128))
  for h in range(num_heads):
    out[:, (2 * h) // pk, (2 * h) % pk, :head_dim] = k[:, h]
    out[:, (2 * h + 1) // pk, (2 * h + 1) % pk, :head_dim] = v[:, h]
  return out.astype(dtype)


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, dtype, expected",
    [
        (8, 128, jnp.bfloat16, (10, 16, 8, 2, 128)),  # the contract's example
        (8, 128, jnp.float32, (10, 16, 16, 1, 128)),
        (3, 128, jnp.bfloat16, (10, 16, 3, 2, 128)),
        (1, 128, jnp.float8_e4m3fn, (10, 16, 1, 4, 128)),  # 2 rows padded to 4
        (3, 128, jnp.int8, (10, 16, 2, 4, 128)),
        (2, 32, jnp.float32, (10, 16, 4, 1, 128)),  # head dim padded to 128
        (2, 200, jnp.bfloat16, (10, 16, 2, 2, 256)),
        (3, 64, jnp.bfloat16, (10, 16, 2, 2, 128)),  # hd64: heads padded to pk, [K64 | V64]
        (4, 64, jnp.float32, (10, 16, 4, 1, 128)),
        (1, 64, jnp.float8_e4m3fn, (10, 16, 1, 4, 128)),
    ],
)
def test_get_kv_cache_shape(num_kv_heads, head_dim, dtype, expected):
  """Shapes of the standard and head-dim-64 layouts for each packing."""
  assert kv_cache_layout.get_kv_cache_shape(10, 16, num_kv_heads, head_dim, dtype) == expected


def test_get_kv_cache_shape_accepts_dtype_names():
  """A dtype name works like a dtype."""
  assert kv_cache_layout.get_kv_cache_shape(2, 4, 8, 128, "bfloat16") == (2, 4, 8, 2, 128)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((0, 16, 8, 128, jnp.float32), ValueError, "num_blocks must be positive; got 0"),
        ((4, -1, 8, 128, jnp.float32), ValueError, "block_size must be positive; got -1"),
        ((4, 16, 2.0, 128, jnp.float32), TypeError, r"num_kv_heads must be an int; got float \(2.0\)"),
        ((4, 16, 8, True, jnp.float32), TypeError, "head_dim must be an int; got bool"),
        ((4, 16, 8, 128, jnp.float64), ValueError, r"8, 16 or 32 bits wide; got float64 \(64 bits\)"),
        ((4, 16, 8, 128, jnp.int4), ValueError, r"got int4 \(4 bits\)"),
        ((4, 16, 8, 128, jnp.bool_), ValueError, "must be a float or integer type; got bool"),
        ((4, 16, 8, 128, jnp.complex64), ValueError, "must be a float or integer type; got complex64"),
    ],
)
def test_get_kv_cache_shape_rejects_bad_input(args, error, match):
  """Bad sizes and dtypes raise with the value given."""
  with pytest.raises(error, match=match):
    kv_cache_layout.get_kv_cache_shape(*args)


@pytest.mark.parametrize(
    "dtype, packing", [(jnp.float32, 1), (jnp.bfloat16, 2), (jnp.float16, 2), (jnp.float8_e4m3fn, 4), (jnp.int8, 4)]
)
def test_get_dtype_packing(dtype, packing):
  """pk = 32 / bits."""
  assert kv_cache_layout.get_dtype_packing(dtype) == packing


@pytest.mark.parametrize("head_dim, padded", [(64, 64), (32, 128), (128, 128), (80, 128), (129, 256), (256, 256)])
def test_get_padded_head_dim(head_dim, padded):
  """64 stays 64, other head dims round up to a multiple of 128."""
  assert kv_cache_layout.get_padded_head_dim(head_dim) == padded
  assert kv_cache_layout.uses_hd64_layout(head_dim) == (head_dim == 64)


@pytest.mark.parametrize("num_heads, shards, padded", [(1, 4, 4), (2, 8, 8), (8, 4, 8), (4, 4, 4), (3, 1, 3)])
def test_get_padded_num_heads(num_heads, shards, padded):
  """Fewer heads than shards are raised to the shard count."""
  assert kv_cache_layout.get_padded_num_heads(num_heads, shards) == padded


@pytest.mark.parametrize(
    "num_heads, shards, match",
    [
        (6, 4, r"num_heads \(6\) must be a multiple of the sharding size \(4\)"),
        (3, 4, r"sharding size \(4\) must be a multiple of num_heads \(3\)"),
        (2, 0, "sharding_size must be positive; got 0"),
    ],
)
def test_get_padded_num_heads_rejects_uneven_split(num_heads, shards, match):
  """Heads that cannot be spread evenly raise."""
  with pytest.raises(ValueError, match=match):
    kv_cache_layout.get_padded_num_heads(num_heads, shards)


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_heads, head_dim, dtype",
    [
        (2, 32, jnp.float32),
        (3, 32, jnp.bfloat16),
        (1, 16, jnp.float8_e4m3fn),
        (2, 128, jnp.bfloat16),
        (2, 136, jnp.float32),
        (3, 64, jnp.bfloat16),
        (2, 64, jnp.float32),
        (1, 64, jnp.float8_e4m3fn),
    ],
)
def test_merge_and_read_kv_match_the_contract_layout(num_heads, head_dim, dtype):
  """merge_kv equals the loop packer; read_kv inverts it."""
  rng = np.random.default_rng(0)
  k = rng.normal(size=(5, num_heads, head_dim)).astype(np.float32)
  v = rng.normal(size=(5, num_heads, head_dim)).astype(np.float32)
  merged = kv_cache_layout.merge_kv(jnp.asarray(k), jnp.asarray(v), dtype)
  expected = _np_pack(k, v, dtype)
  assert merged.dtype == jnp.dtype(dtype)
  assert merged.shape == expected.shape == (5, *kv_cache_layout.get_kv_cache_shape(1, 1, num_heads, head_dim, dtype)[2:])
  np.testing.assert_array_equal(np.asarray(merged).astype(np.float64), expected.astype(np.float64))
  k_back, v_back = kv_cache_layout.read_kv(merged, num_heads, head_dim)
  assert k_back.shape == v_back.shape == (5, num_heads, head_dim)
  np.testing.assert_array_equal(np.asarray(k_back, np.float64), k.astype(dtype).astype(np.float64))
  np.testing.assert_array_equal(np.asarray(v_back, np.float64), v.astype(dtype).astype(np.float64))


def test_read_kv_accepts_leading_axes():
  """Pages with extra leading axes unpack too."""
  rng = np.random.default_rng(1)
  k = rng.normal(size=(2, 3, 2, 32)).astype(np.float32)
  v = rng.normal(size=(2, 3, 2, 32)).astype(np.float32)
  merged = kv_cache_layout.merge_kv(jnp.asarray(k), jnp.asarray(v), jnp.float32)
  assert merged.shape == (2, 3, 4, 1, 128)
  k_back, v_back = kv_cache_layout.read_kv(merged, 2, 32)
  np.testing.assert_array_equal(np.asarray(k_back), k)
  np.testing.assert_array_equal(np.asarray(v_back), v)


def test_merge_kv_rejects_mismatched_shapes():
  """k and v must agree in shape."""
  with pytest.raises(ValueError, match=r"one shape \[..., H, d\]; got k \(2, 3, 8\) and v \(2, 3, 4\)"):
    kv_cache_layout.merge_kv(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 4)), jnp.float32)


def test_read_kv_rejects_rows_of_another_layout():
  """Rows of another head count or rank raise with the expected shape."""
  rows = jnp.zeros((4, 4, 1, 128), jnp.float32)  # 2 heads of dim 32, fp32
  with pytest.raises(
      ValueError, match=r"for 3 KV heads of dim 32 in float32 over 1 shard\(s\) must end in \(6, 1, 128\); got shape"
  ):
    kv_cache_layout.read_kv(rows, 3, 32)
  with pytest.raises(ValueError, match="must end in"):
    kv_cache_layout.read_kv(jnp.zeros((1, 128)), 1, 32)


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, dtype, num_shards, expected_rows",
    [
        (4, 64, jnp.bfloat16, 4, 4),  # one head per shard, each padded to a pair: 4 rows where one shard needs 2
        (4, 64, jnp.bfloat16, 2, 2),  # two heads per shard fill their pair: the unsharded layout
        (8, 64, jnp.bfloat16, 8, 8),
        (6, 64, jnp.bfloat16, 2, 4),  # 3 heads per shard -> 2 rows each
        (4, 64, jnp.float32, 4, 4),  # fp32 packs one per row: no padding either way
        (4, 128, jnp.bfloat16, 4, 4),  # K and V of a head fill a pair: the unsharded layout
        (2, 128, jnp.int8, 2, 2),  # 2 rows per shard padded to 4 slots
    ],
)
def test_sharded_cache_shape_packs_each_shard_alone(num_kv_heads, head_dim, dtype, num_shards, expected_rows):
  """Each tensor-parallel shard holds the layout of its own heads, so the packed axis is S blocks of rows."""
  shape = kv_cache_layout.get_kv_cache_shape(10, 16, num_kv_heads, head_dim, dtype, num_shards)
  assert shape[2] == expected_rows
  assert shape[2] % num_shards == 0


def test_sharded_merge_puts_each_shards_heads_in_its_own_rows():
  """hd64 bf16, 2 heads over 2 shards: row s holds head s and a zero pad slot (written out by hand)."""
  k = jnp.arange(2 * 64, dtype=jnp.float32).reshape(1, 2, 64) + 1
  v = -k
  rows = np.asarray(kv_cache_layout.merge_kv(k, v, jnp.bfloat16, num_shards=2).astype(jnp.float32))
  assert rows.shape == (1, 2, 2, 128)
  for shard in range(2):
    np.testing.assert_array_equal(rows[0, shard, 0, :64], np.asarray(k[0, shard]))
    np.testing.assert_array_equal(rows[0, shard, 0, 64:], np.asarray(v[0, shard]))
    np.testing.assert_array_equal(rows[0, shard, 1], np.zeros(128))
  # One shard packs both heads into one row instead.
  unsharded = np.asarray(kv_cache_layout.merge_kv(k, v, jnp.bfloat16).astype(jnp.float32))
  assert unsharded.shape == (1, 1, 2, 128)
  np.testing.assert_array_equal(unsharded[0, 0, 1, :64], np.asarray(k[0, 1]))


@pytest.mark.parametrize("num_shards", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sharded_merge_and_read_round_trip(num_shards, head_dim):
  rng = np.random.default_rng(num_shards)
  k = rng.normal(size=(3, 4, head_dim)).astype(np.float32)
  v = rng.normal(size=(3, 4, head_dim)).astype(np.float32)
  rows = kv_cache_layout.merge_kv(jnp.asarray(k), jnp.asarray(v), jnp.float32, num_shards)
  assert rows.shape[1:] == kv_cache_layout.get_kv_cache_shape(1, 1, 4, head_dim, jnp.float32, num_shards)[2:]
  k_back, v_back = kv_cache_layout.read_kv(rows, 4, head_dim, num_shards)
  np.testing.assert_array_equal(np.asarray(k_back), k)
  np.testing.assert_array_equal(np.asarray(v_back), v)


def test_shards_must_split_the_heads():
  with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must be a multiple of num_shards \(2\)"):
    kv_cache_layout.get_kv_cache_shape(1, 16, 3, 64, jnp.bfloat16, 2)
  rows = jnp.zeros((2, 1, 2, 128), jnp.bfloat16)  # the unsharded rows of 2 hd64 heads
  with pytest.raises(ValueError, match=r"over 2 shard\(s\) must end in \(2, 2, 128\)"):
    kv_cache_layout.read_kv(rows, 2, 64, num_shards=2)
