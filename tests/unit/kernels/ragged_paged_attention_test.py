"""Tests for ragged_paged_attention against a float64 NumPy reference written here (loops over requests)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels import ragged_paged_attention as rpa

F32_TOL = 2e-5
BF16_TOL = 2e-2

# (tokens already cached, new tokens): two decodes, a fresh prefill and a chunked prefill continuing from cache.
MIXED = ((5, 1), (12, 1), (0, 6), (7, 3))


def _quant(x, dtype) -> np.ndarray:
  """Rounds to `dtype` (as stored in the cache) and returns float64."""
  return np.asarray(x, np.float64).astype(dtype).astype(np.float64)


def _pack(kpool: np.ndarray, vpool: np.ndarray, dtype) -> np.ndarray:
  """Builds the physical cache `[N, bs, R, pk, dp]` from logical K/V pools `[N, bs, H, d]`, head by head."""
  num_blocks, block_size, num_heads, head_dim = kpool.shape
  pk = 4 // np.dtype(dtype).itemsize
  if head_dim == 64:
    out = np.zeros((num_blocks, block_size, -(-num_heads // pk), pk, 128))
    for h in range(num_heads):
      out[:, :, h // pk, h % pk, :64] = kpool[:, :, h]
      out[:, :, h // pk, h % pk, 64:] = vpool[:, :, h]
    return out.astype(dtype)
  out = np.zeros((num_blocks, block_size, -(-(2 * num_heads) // pk), pk, -(-head_dim // 128) * 128))
  for h in range(num_heads):
    out[:, :, (2 * h) // pk, (2 * h) % pk, :head_dim] = kpool[:, :, h]
    out[:, :, (2 * h + 1) // pk, (2 * h + 1) % pk, :head_dim] = vpool[:, :, h]
  return out.astype(dtype)


@dataclasses.dataclass
class Batch:
  """One attention batch: inputs, logical K/V pools and the ragged metadata."""

  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  kpool: np.ndarray  # [N, bs, Hkv, d] float64, already rounded to the cache dtype
  vpool: np.ndarray
  kv_lens: np.ndarray
  page_table: np.ndarray
  cu_q_lens: np.ndarray
  distribution: np.ndarray
  cache_dtype: object

  @property
  def num_valid_tokens(self) -> int:
    """Tokens of real requests (the rest is padding)."""
    return int(self.cu_q_lens[self.distribution[2]])

  def cache(self) -> jax.Array:
    """The physical cache packed from the pools."""
    return jnp.asarray(_pack(self.kpool, self.vpool, self.cache_dtype))


def _make_batch(
    seed,
    requests,
    *,
    hq=4,
    hkv=2,
    d=32,
    block_size=4,
    num_tokens=16,
    max_reqs=6,
    extra_pages=1,
    num_blocks=None,
    cache_dtype=np.float32,
    in_dtype=np.float32,
) -> Batch:
  """A ragged batch with shuffled page ids, garbage in every unused cache row (page 0 too) and padded tails."""
  rng = np.random.default_rng(seed)
  pages_per_seq = max(-(-(p + n) // block_size) for p, n in requests) + extra_pages
  needed = sum(-(-(p + n) // block_size) for p, n in requests)
  num_blocks = num_blocks or needed + 4
  kv_lens = np.zeros(max_reqs, np.int32)
  cu = np.zeros(max_reqs + 1, np.int32)
  table = np.zeros(max_reqs * pages_per_seq, np.int32)
  free = list(rng.permutation(np.arange(1, num_blocks)))  # page 0 is the null page
  for i, (prior, new) in enumerate(requests):
    pages = -(-(prior + new) // block_size)
    table[i * pages_per_seq : i * pages_per_seq + pages] = [free.pop() for _ in range(pages)]
    kv_lens[i] = prior + new
    cu[i + 1] = cu[i] + new
  cu[len(requests) + 1 :] = cu[len(requests)]
  assert cu[-1] <= num_tokens
  num_decode = 0
  while num_decode < len(requests) and requests[num_decode][1] == 1:
    num_decode += 1
  return Batch(
      q=rng.normal(size=(num_tokens, hq, d)).astype(in_dtype),
      k=rng.normal(size=(num_tokens, hkv, d)).astype(in_dtype),
      v=rng.normal(size=(num_tokens, hkv, d)).astype(in_dtype),
      kpool=_quant(rng.normal(size=(num_blocks, block_size, hkv, d)), cache_dtype),
      vpool=_quant(rng.normal(size=(num_blocks, block_size, hkv, d)), cache_dtype),
      kv_lens=kv_lens,
      page_table=table,
      cu_q_lens=cu,
      distribution=np.array([num_decode, num_decode, len(requests)], np.int32),
      cache_dtype=cache_dtype,
  )


def _reference(b: Batch, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None, update_kv_cache=True):
  """Float64 loops: write the new K/V into the logical pools, then attend per request, token and head."""
  kpool, vpool = b.kpool.copy(), b.vpool.copy()
  block_size = kpool.shape[1]
  pages_per_seq = len(b.page_table) // len(b.kv_lens)
  hq, hkv = b.q.shape[1], kpool.shape[2]

  def slot(i, p):
    return b.page_table[i * pages_per_seq + p // block_size], p % block_size

  if update_kv_cache:
    for i in range(b.distribution[2]):
      qs, ql, kv_len = b.cu_q_lens[i], b.cu_q_lens[i + 1] - b.cu_q_lens[i], b.kv_lens[i]
      for j in range(ql):
        kpool[slot(i, kv_len - ql + j)] = _quant(b.k[qs + j], b.cache_dtype)
        vpool[slot(i, kv_len - ql + j)] = _quant(b.v[qs + j], b.cache_dtype)
  out = np.zeros(b.q.shape)
  q = b.q.astype(np.float64)
  for i in range(b.distribution[2]):
    qs, ql, kv_len = b.cu_q_lens[i], b.cu_q_lens[i + 1] - b.cu_q_lens[i], b.kv_lens[i]
    keys = np.stack([kpool[slot(i, p)] for p in range(kv_len)])  # [L, Hkv, d]
    values = np.stack([vpool[slot(i, p)] for p in range(kv_len)])
    for j in range(ql):
      qp = kv_len - ql + j
      pos = np.arange(kv_len)
      keep = pos <= qp
      if sliding_window is not None:
        keep &= qp - pos < sliding_window
      for h in range(hq):
        kh = h // (hq // hkv)
        logits = keys[:, kh] @ q[qs + j, h] * sm_scale
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        logits = logits[keep]
        top = logits.max() if sinks is None else max(logits.max(), float(sinks[h]))
        weights = np.exp(logits - top)
        denom = weights.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
        out[qs + j, h] = weights @ values[keep, kh] / denom
  return out, kpool, vpool


@functools.lru_cache(maxsize=None)
def _jitted(update_kv_cache=True, sinks=None, **kwargs):
  """One compiled kernel per option set (sinks passed as a tuple to stay hashable)."""
  if sinks is not None:
    kwargs["sinks"] = jnp.asarray(sinks, jnp.float32)
  return jax.jit(functools.partial(rpa.ragged_paged_attention, update_kv_cache=update_kv_cache, **kwargs))


def _run(b: Batch, cache=None, **kwargs):
  if kwargs.get("sinks") is not None:
    kwargs["sinks"] = tuple(float(x) for x in kwargs["sinks"])
  update = kwargs.get("update_kv_cache", True)
  return _jitted(**kwargs)(
      jnp.asarray(b.q),
      jnp.asarray(b.k) if update else None,
      jnp.asarray(b.v) if update else None,
      b.cache() if cache is None else cache,
      jnp.asarray(b.kv_lens),
      jnp.asarray(b.page_table),
      jnp.asarray(b.cu_q_lens),
      jnp.asarray(b.distribution),
  )


def _check(b: Batch, out, new_cache, tol=F32_TOL, **kwargs):
  ref_out, kpool, vpool = _reference(b, **kwargs)
  valid = b.num_valid_tokens
  assert out.shape == b.q.shape and out.dtype == b.q.dtype
  out = np.asarray(out, np.float64)
  np.testing.assert_allclose(out[:valid], ref_out[:valid], atol=tol, rtol=tol)
  np.testing.assert_array_equal(out[valid:], 0.0)  # padded tokens
  # Written rows hold the new K/V; every other row, page 0 included, is bit-for-bit untouched.
  assert new_cache.dtype == jnp.dtype(b.cache_dtype)
  np.testing.assert_array_equal(
      np.asarray(new_cache).astype(np.float64), _pack(kpool, vpool, b.cache_dtype).astype(np.float64)
  )


@pytest.mark.parametrize(
    "hq, hkv, d, cache_dtype",
    [
        (4, 2, 32, np.float32),  # head dim padded 32 -> 128
        (4, 2, 32, jnp.bfloat16),  # pk = 2
        (6, 3, 64, jnp.bfloat16),  # head-dim-64 layout, 3 heads padded to 4 rows
        (4, 4, 64, np.float32),
        (2, 1, 16, jnp.float8_e4m3fn),  # pk = 4: 2 K/V rows padded to 4
        (4, 1, 128, jnp.bfloat16),  # GQA group 4, no head-dim padding
    ],
)
def test_mixed_batch_matches_reference(hq, hkv, d, cache_dtype):
  """Mixed batch per layout: head-dim padding, packing 1/2/4, head-dim 64, GQA."""
  b = _make_batch(0, MIXED, hq=hq, hkv=hkv, d=d, cache_dtype=cache_dtype)
  out, new_cache = _run(b, sm_scale=d**-0.5)
  _check(b, out, new_cache, sm_scale=d**-0.5)


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_page_sizes(block_size):
  """Several page sizes, requests not ordered decode-first."""
  requests = ((9, 1), (0, 5), (17, 4), (3, 1))  # decodes not first: the kernel must not rely on the order
  b = _make_batch(1, requests, block_size=block_size, num_tokens=12, max_reqs=5)
  out, new_cache = _run(b, sm_scale=0.2)
  _check(b, out, new_cache, sm_scale=0.2)


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 3},
        {"sliding_window": 2, "mask_value": -1e30},
        {"soft_cap": 1.5},
        {"sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)},
        {"sliding_window": 4, "soft_cap": 2.0, "sinks": np.array([1.0, 3.0, -2.0, 0.5], np.float32)},
    ],
)
def test_window_soft_cap_and_sinks(options):
  """Sliding window shorter than the sequences, soft cap and sinks, alone and combined."""
  b = _make_batch(2, MIXED, hq=4, hkv=2, d=64, cache_dtype=jnp.bfloat16)
  out, new_cache = _run(b, sm_scale=0.3, **options)
  _check(b, out, new_cache, sm_scale=0.3, **{k: v for k, v in options.items() if k != "mask_value"})


@pytest.mark.slow
@pytest.mark.parametrize("query_block_size", [1, 3, 16])
def test_query_block_size_does_not_change_results(query_block_size):
  """Blocks of 1, 3 (with a remainder) and all tokens agree."""
  b = _make_batch(3, MIXED)
  out, new_cache = _run(b, sm_scale=0.25, query_block_size=query_block_size)
  _check(b, out, new_cache, sm_scale=0.25)


def test_bf16_inputs_and_cache():
  """bf16 q/k/v and cache, bf16 output."""
  b = _make_batch(4, MIXED, hq=4, hkv=2, d=32, cache_dtype=jnp.bfloat16, in_dtype=jnp.bfloat16)
  out, new_cache = _run(b, sm_scale=32**-0.5)
  _check(b, out, new_cache, tol=BF16_TOL, sm_scale=32**-0.5)


def test_without_cache_update_reads_the_pages_as_given():
  """KV-sharing layers read what the source layer wrote."""
  b = _make_batch(5, MIXED, cache_dtype=jnp.bfloat16)
  _, kpool, vpool = _reference(b, sm_scale=0.3)  # the cache after the source layer wrote this step's K/V
  shared = dataclasses.replace(b, kpool=kpool, vpool=vpool)
  cache = shared.cache()
  out, new_cache = _run(shared, cache=cache, sm_scale=0.3, update_kv_cache=False, num_kv_heads=2)
  _check(shared, out, new_cache, sm_scale=0.3, update_kv_cache=False)
  # k/v may still be passed: they are ignored.
  args = [jnp.asarray(x) for x in (b.kv_lens, b.page_table, b.cu_q_lens, b.distribution)]
  out2, new_cache2 = _jitted(update_kv_cache=False, sm_scale=0.3)(
      jnp.asarray(b.q), jnp.zeros_like(b.k), jnp.zeros_like(b.v), cache, *args
  )
  np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(new_cache2), np.asarray(cache))


def _precompile_dummy(b: Batch) -> Batch:
  """`b` with the runner's precompile metadata: seq_lens and query_start_loc all ones, zero tables, distribution
  zeros (no real request)."""
  num_seqs = len(b.kv_lens)
  return dataclasses.replace(
      b,
      kv_lens=np.ones(num_seqs, np.int32),
      cu_q_lens=np.ones(num_seqs + 1, np.int32),
      page_table=np.zeros_like(b.page_table),
      distribution=np.zeros(3, np.int32),
  )


def test_zero_requests_precompile_dummy():
  """The runner's precompile metadata: seq_lens and query_start_loc all ones, zero tables, distribution zeros."""
  b = _precompile_dummy(_make_batch(6, ((3, 2),), num_tokens=8, max_reqs=4))
  out, new_cache = _run(b, sm_scale=1.0)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(b.cache()))


def test_padded_requests_and_tokens_do_not_touch_page_zero():
  """Many padded rows pointing at page 0 leave it intact."""
  b = _make_batch(7, ((0, 3), (4, 1)), num_tokens=16, max_reqs=8)
  out, new_cache = _run(b, sm_scale=0.5)
  np.testing.assert_array_equal(np.asarray(new_cache)[0], np.asarray(b.cache())[0])
  _check(b, out, new_cache, sm_scale=0.5)


@pytest.mark.parametrize("cache_dtype, window", [(np.float32, None), (jnp.bfloat16, 4)])
def test_chunked_prefill_and_decodes_equal_one_shot(cache_dtype, window):
  """A prefill of 7 tokens then 4 decodes, carrying the cache, equals one prefill of 11 tokens."""
  total, first = 11, 7
  one = _make_batch(8, ((0, total),), num_tokens=16, max_reqs=2, block_size=4, cache_dtype=cache_dtype)
  kwargs = {"sm_scale": 0.3, "sliding_window": window}
  one_out, one_cache = _run(one, **kwargs)
  _check(one, one_out, one_cache, **kwargs)

  cache = one.cache()
  outs = []
  for start, count in [(0, first)] + [(t, 1) for t in range(first, total)]:
    step = dataclasses.replace(
        one,
        q=np.zeros_like(one.q),
        k=np.zeros_like(one.k),
        v=np.zeros_like(one.v),
        kv_lens=np.array([start + count, 0], np.int32),
        cu_q_lens=np.array([0, count, count], np.int32),
        distribution=np.array([int(count == 1), int(count == 1), 1], np.int32),
    )
    for name in ("q", "k", "v"):
      getattr(step, name)[:count] = getattr(one, name)[start : start + count]
    step_out, cache = _run(step, cache=cache, **kwargs)
    outs.append(np.asarray(step_out)[:count])
  np.testing.assert_allclose(np.concatenate(outs), np.asarray(one_out)[:total], atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache), np.asarray(one_cache))


def _valid_args():
  b = _make_batch(9, ((0, 2),), num_tokens=4, max_reqs=2, hq=4, hkv=2, d=32)
  return {
      "q": jnp.asarray(b.q),
      "k": jnp.asarray(b.k),
      "v": jnp.asarray(b.v),
      "kv_cache": b.cache(),
      "kv_lens": jnp.asarray(b.kv_lens),
      "page_indices": jnp.asarray(b.page_table),
      "cu_q_lens": jnp.asarray(b.cu_q_lens),
      "distribution": jnp.asarray(b.distribution),
      "sm_scale": 1.0,
  }


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"q": jnp.zeros((4, 32))}, ValueError, r"q must be \[T, Hq, d\]; got shape \(4, 32\)"),
        ({"k": jnp.zeros((4, 2, 16))}, ValueError, r"k and v must both be \[T, Hkv, d\] = \[4, Hkv, 32\]"),
        ({"k": None, "update_kv_cache": False}, ValueError, "pass both k and v or neither"),
        ({"k": None, "v": None}, ValueError, "update_kv_cache=True needs k and v"),
        ({"k": None, "v": None, "update_kv_cache": False}, ValueError, "num_kv_heads is required when k and v"),
        ({"num_kv_heads": 1}, ValueError, r"num_kv_heads=1 disagrees with k \(4, 2, 32\)"),
        ({"k": jnp.zeros((4, 3, 32)), "v": jnp.zeros((4, 3, 32))}, ValueError, r"Hq \(4\) must be a positive multiple"),
        ({"kv_cache": jnp.zeros((9, 3, 160), jnp.bfloat16)}, ValueError, r"rank 5 .* got shape \(9, 3, 160\) bfloat16"),
        (
            {"kv_cache": jnp.zeros((6, 4, 4, 1, 128), jnp.bfloat16)},  # float32-shaped rows in bfloat16
            ValueError,
            r"bfloat16 cache for 2 KV heads of dim 32 must have shape \(6, 4, 2, 2, 128\); got \(6, 4, 4, 1, 128\)",
        ),
        ({"kv_lens": jnp.zeros((2, 1), jnp.int32)}, ValueError, r"kv_lens must be \[S\]"),
        ({"kv_lens": jnp.zeros((0,), jnp.int32)}, ValueError, r"at least one request row \(S >= 1\); got S = 0"),
        ({"cu_q_lens": jnp.zeros((4,), jnp.int32)}, ValueError, r"query_start_loc must have shape \(S \+ 1,\) = \(3,\)"),
        ({"distribution": jnp.zeros((6,), jnp.int32)}, ValueError, r"distribution must have shape \(3,\); got \(6,\)"),
        ({"page_indices": jnp.zeros((7,), jnp.int32)}, ValueError, r"flat \[S \* P\] table .* got shape \(7,\)"),
        ({"sinks": jnp.zeros((2,))}, ValueError, r"sinks must have shape \(Hq,\) = \(4,\); got \(2,\)"),
        ({"sm_scale": None}, TypeError, "sm_scale must be a float; got None"),
        ({"sm_scale": jnp.float32(1.0)}, TypeError, "sm_scale must be a float"),
        ({"sliding_window": 0}, ValueError, "sliding_window must be positive when set; got 0"),
        ({"sliding_window": 2.5}, TypeError, "sliding_window must be an int or None; got 2.5"),
        ({"soft_cap": -1.0}, ValueError, "soft_cap must be positive when set; got -1.0"),
        ({"query_block_size": 0}, ValueError, "query_block_size must be positive when set"),
    ],
)
def test_rejects_bad_arguments(change, error, match):
  """Static checks name the argument, the expectation and the value."""
  args = _valid_args()
  args.update(change)
  with pytest.raises(error, match=match):
    rpa.ragged_paged_attention(**args)


@pytest.mark.parametrize(
    "num_tokens, num_seqs, expected",
    [(8, 8, 1), (4, 8, 1), (16, 8, 2), (128, 8, 16), (100, 8, 16), (512, 8, 64), (4096, 2, 64), (64, 1, 64)],
)
def test_default_query_block_size_follows_tokens_per_request(num_tokens, num_seqs, expected):
  """Decodes get one query per item; prefills the power of two at or above the mean, at most 64."""
  assert rpa.default_query_block_size(num_tokens, num_seqs) == expected


@pytest.mark.slow
@pytest.mark.parametrize("query_block_size", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("seed", range(4))
def test_work_items_cover_every_request_split(seed, query_block_size):
  """Random request lengths: the static item count is enough, so no query is left out."""
  rng = np.random.default_rng(seed)
  num_requests = int(rng.integers(1, 6))
  requests = tuple((int(rng.integers(0, 9)), int(rng.integers(1, 8))) for _ in range(num_requests))
  num_tokens = sum(n for _, n in requests) + int(rng.integers(0, 3))
  needed = sum(-(-n // query_block_size) for _, n in requests)
  assert needed <= rpa.num_work_items(num_tokens, 6, query_block_size)
  b = _make_batch(seed, requests, num_tokens=num_tokens, max_reqs=6)
  out, new_cache = _run(b, sm_scale=0.3, query_block_size=query_block_size)
  _check(b, out, new_cache, sm_scale=0.3)


def test_items_per_batch_respects_the_budget():
  """Small problems run as one vectorised batch; large ones are cut into batches within the budget."""
  cache = jnp.zeros((2, 16, 8, 1, 128), jnp.float32)
  assert rpa.items_per_batch(cache, pages_per_seq=4, num_q_heads=8, query_block_size=16) == (64 << 20) // (
      64 * 8 * 128 * 12 + 2 * 16 * 64 * 8 * 4
  )
  big = jax.ShapeDtypeStruct((2, 1024, 8, 1, 128), jnp.float32)
  per_item = 64 * 1024 * 8 * 128 * 12 + 2 * 64 * 64 * 1024 * 8 * 4
  assert rpa.items_per_batch(big, pages_per_seq=64, num_q_heads=8, query_block_size=64) == max(1, (64 << 20) // per_item)


def test_items_past_the_budget_run_in_batches(monkeypatch):
  """A budget of one item's pages makes the kernel loop over items; the results do not change."""
  b = _make_batch(13, MIXED)
  monkeypatch.setattr(rpa, "_GATHER_BUDGET_BYTES", 1)
  out, new_cache = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=0.25, query_block_size=2))(
      *(jnp.asarray(x) for x in (b.q, b.k, b.v)),
      b.cache(),
      *(jnp.asarray(x) for x in (b.kv_lens, b.page_table, b.cu_q_lens, b.distribution)),
  )
  _check(b, out, new_cache, sm_scale=0.25)


@pytest.mark.parametrize("num_requests", [0, 1])
def test_one_token_batch(num_requests):
  """T = 1 (the engine's bucket for a lone decode): the request's row is written in place, a padding token writes
  nothing."""
  b = _make_batch(12, ((9, 1),), num_tokens=1, max_reqs=4)
  if num_requests == 0:
    b = dataclasses.replace(b, cu_q_lens=np.zeros(5, np.int32), distribution=np.zeros(3, np.int32))
  out, new_cache = _run(b, sm_scale=0.7)
  _check(b, out, new_cache, sm_scale=0.7)
  if num_requests == 0:
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(b.cache()))


def _pack_sharded(kpool: np.ndarray, vpool: np.ndarray, dtype, num_shards: int) -> np.ndarray:
  """The per-shard cache: each shard's heads packed on their own (`_pack`), shard blocks along the packed axis."""
  heads = kpool.shape[2] // num_shards
  blocks = [
      _pack(kpool[:, :, s * heads : (s + 1) * heads], vpool[:, :, s * heads : (s + 1) * heads], dtype)
      for s in range(num_shards)
  ]
  return np.concatenate(blocks, axis=2)


@pytest.mark.parametrize("hkv, d", [(2, 64), (4, 64), (2, 32)])
def test_cache_laid_out_per_shard_attends_like_the_reference(hkv, d):
  """A cache in the tensor-parallel layout (one block of rows per shard, each padded on its own) is read and written
  where that layout puts each head: the output is the float64 reference's and the cache the reference pools packed
  per shard."""
  b = _make_batch(7, MIXED, hq=4, hkv=hkv, d=d, cache_dtype=jnp.bfloat16)
  shards = hkv
  cache = jnp.asarray(_pack_sharded(b.kpool, b.vpool, b.cache_dtype, shards))
  out, new_cache = _run(b, cache=cache, sm_scale=0.3, num_kv_shards=shards)
  ref_out, kpool, vpool = _reference(b, sm_scale=0.3)
  valid = b.num_valid_tokens
  np.testing.assert_allclose(np.asarray(out, np.float64)[:valid], ref_out[:valid], atol=F32_TOL, rtol=F32_TOL)
  np.testing.assert_array_equal(
      np.asarray(new_cache).astype(np.float64), _pack_sharded(kpool, vpool, b.cache_dtype, shards).astype(np.float64)
  )
