"""Tests for the CPU paged attention kernel: against the float64 reference of ragged_paged_attention_test, beside
the pure-JAX attention, its dispatch rule and its argument checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# A sibling test module (pytest puts this folder on sys.path): its float64 reference and batch builder.
from ragged_paged_attention_test import (  # pylint: disable=import-error
    F32_TOL,
    MIXED,
    _check,
    _make_batch,
    _precompile_dummy,
    _reference,
)

from maxtext.kernels.cpu import cpu_attention, cpu_gemm
from maxtext.kernels import ragged_paged_attention as rpa
from maxtext.kernels.cpu.backend import CpuBackend

pytestmark = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


def _args(b):
  return (
      jnp.asarray(b.q),
      jnp.asarray(b.k),
      jnp.asarray(b.v),
      b.cache(),
      *(jnp.asarray(x) for x in (b.kv_lens, b.page_table, b.cu_q_lens, b.distribution)),
  )


def _run(b, kernel=True, **kwargs):
  """The paged attention jitted on the cpu backend (`kernel`), else the reference op; also whether its program calls
  the kernel."""
  if kwargs.get("sinks") is not None:
    kwargs["sinks"] = jnp.asarray(kwargs["sinks"], jnp.float32)
  backend = CpuBackend()

  def fn(*args):
    if not kernel:
      return rpa.ragged_paged_attention(*args, **kwargs)
    return backend.ragged_paged_attention(
        *args,
        kwargs.get("sinks"),
        kwargs["sm_scale"],
        kwargs.get("sliding_window"),
        update_kv_cache=kwargs.get("update_kv_cache", True),
        attn_logits_soft_cap=kwargs.get("soft_cap"),
        num_kv_heads=kwargs.get("num_kv_heads"),
    )

  args = _args(b)
  called = "maxtext_paged_attention" in jax.jit(fn).lower(*args).as_text()
  out, new_cache = jax.jit(fn)(*args)
  return out, new_cache, called


@pytest.mark.parametrize(
    "hq, hkv, d",
    [
        (4, 2, 32),  # head dim padded 32 -> 128
        (4, 4, 64),  # head-dim-64 layout [K | V]
        (8, 2, 128),  # GQA group 4, no padding
        (6, 3, 20),  # head dim not a multiple of 8: the scalar tails
    ],
)
def test_mixed_batch_matches_the_float64_reference(hq, hkv, d):
  """Decodes, a fresh prefill and a chunked prefill, padded tokens and requests, per cache layout."""
  b = _make_batch(0, MIXED, hq=hq, hkv=hkv, d=d)
  out, new_cache, called = _run(b, sm_scale=d**-0.5)
  assert called
  _check(b, out, new_cache, sm_scale=d**-0.5)


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 3},
        {"sliding_window": 1},
        {"soft_cap": 1.5},
        {"sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)},
        {"sliding_window": 4, "soft_cap": 2.0, "sinks": np.array([1.0, 3.0, -2.0, 0.5], np.float32)},
    ],
)
def test_window_soft_cap_and_sinks(options):
  b = _make_batch(2, MIXED, hq=4, hkv=2, d=64)
  out, new_cache, called = _run(b, sm_scale=0.3, **options)
  assert called
  _check(b, out, new_cache, sm_scale=0.3, **options)


@pytest.mark.parametrize("block_size", [2, 16])
def test_page_sizes_and_request_order(block_size):
  b = _make_batch(1, ((9, 1), (0, 5), (17, 4), (3, 1)), block_size=block_size, num_tokens=12, max_reqs=5)
  out, new_cache, called = _run(b, sm_scale=0.2)
  assert called
  _check(b, out, new_cache, sm_scale=0.2)


@pytest.mark.slow
def test_a_long_prefill_takes_the_threaded_path_and_equals_the_jax_attention():
  """Enough work for the helper threads (64 queries x 4 KV heads x up to 300 keys); same as the pure-JAX path."""
  b = _make_batch(3, ((236, 64), (40, 1)), hq=8, hkv=4, d=64, block_size=16, num_tokens=72, max_reqs=3)
  out, new_cache, called = _run(b, sm_scale=0.125, sliding_window=200)
  assert called
  _check(b, out, new_cache, sm_scale=0.125, sliding_window=200)
  jax_out, jax_cache, jax_called = _run(b, kernel=False, sm_scale=0.125, sliding_window=200)
  assert not jax_called
  np.testing.assert_allclose(np.asarray(out), np.asarray(jax_out), rtol=F32_TOL, atol=F32_TOL)
  np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(jax_cache))


def test_precompile_dummy_and_positions_outside_the_pages_give_zero_rows():
  """The runner's precompile metadata (no real request) and a KV length past the block table read nothing."""
  b = _make_batch(6, ((3, 2),), num_tokens=8, max_reqs=4)
  out, _, called = _run(_precompile_dummy(b), sm_scale=1.0)
  assert called
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  pages_per_seq = len(b.page_table) // len(b.kv_lens)
  past = dataclasses.replace(b, kv_lens=np.array([pages_per_seq * 4 + 2, 0, 0, 0], np.int32))
  out, _, _ = _run(past, sm_scale=1.0, update_kv_cache=False, num_kv_heads=2)
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_page_ids_outside_the_cache_are_clamped_like_the_jax_gather():
  b = _make_batch(4, ((5, 1), (6, 1)), num_tokens=2, max_reqs=2)
  table = b.page_table.copy()
  table[0] = 10_000  # the page of positions 0-3 of request 0
  table[len(table) // 2] = -3  # request 1's first page
  bad = dataclasses.replace(b, page_table=table)
  kernel_out, _, _ = _run(bad, sm_scale=0.4, update_kv_cache=False, num_kv_heads=2)
  jax_out, _, _ = _run(bad, kernel=False, sm_scale=0.4, update_kv_cache=False, num_kv_heads=2)
  np.testing.assert_allclose(np.asarray(kernel_out), np.asarray(jax_out), rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize(
    "q_dtype, cache_dtype, options, expected",
    [
        (jnp.float32, jnp.float32, {}, True),
        (jnp.bfloat16, jnp.float32, {}, False),
        (jnp.float32, jnp.bfloat16, {}, False),  # a packed cache stays on the JAX path
        (jnp.float32, jnp.float32, {"mask_value": -1e4}, False),  # masked keys would weigh exp(-1e4 - max)
        (jnp.float32, jnp.float32, {"soft_cap": 0.0}, False),
        (jnp.float32, jnp.float32, {"sliding_window": 0}, False),
        (jnp.float32, jnp.float32, {"soft_cap": 30.0, "sliding_window": 512}, True),
    ],
)
def test_applies(q_dtype, cache_dtype, options, expected):
  kwargs = {"mask_value": None, "soft_cap": None, "sliding_window": None, **options}
  assert cpu_attention.applies(q_dtype, cache_dtype, **kwargs) is expected


def test_the_reference_op_never_calls_the_kernel():
  b = _make_batch(5, MIXED)
  out, new_cache, called = _run(b, kernel=False, sm_scale=0.3, mask_value=-1e30)
  assert not called
  _check(b, out, new_cache, sm_scale=0.3)


def test_the_backend_keeps_the_reference_attention_for_a_bfloat16_query():
  b = _make_batch(5, MIXED)
  args = [a.astype(jnp.bfloat16) if i == 0 else a for i, a in enumerate(_args(b))]
  text = jax.jit(lambda *a: CpuBackend().ragged_paged_attention(*a, None, 0.3)).lower(*args).as_text()
  assert "maxtext_paged_attention" not in text


def _attend_args():
  b = _make_batch(7, MIXED, hq=4, hkv=2, d=32)
  _, kpool, vpool = _reference(b, sm_scale=0.3)
  b = dataclasses.replace(b, kpool=kpool, vpool=vpool)
  meta = {
      name: jnp.asarray(x)
      for name, x in zip(
          ("kv_lens", "page_indices", "cu_q_lens", "distribution"), (b.kv_lens, b.page_table, b.cu_q_lens, b.distribution)
      )
  }
  return b, {"q": jnp.asarray(b.q), "cache": b.cache(), **meta}


def test_attend_alone_matches_the_reference():
  b, args = _attend_args()
  out = cpu_attention.attend(**args, num_kv_heads=2, sm_scale=0.3)
  want, _, _ = _reference(b, sm_scale=0.3, update_kv_cache=False)
  valid = b.num_valid_tokens
  np.testing.assert_allclose(np.asarray(out)[:valid], want[:valid], rtol=F32_TOL, atol=F32_TOL)
  np.testing.assert_array_equal(np.asarray(out)[valid:], 0.0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"q": jnp.zeros((4, 4, 32), jnp.bfloat16)}, r"q must be float32 \[T, Hq, d\]; got bfloat16"),
        ({"num_kv_heads": 3}, r"Hq \(4\) must be a multiple of num_kv_heads \(3\)"),
        ({"num_kv_heads": 0}, r"num_kv_heads must be a positive int; got 0"),
        (
            {"cache": jnp.zeros((8, 4, 4, 1, 64))},
            r"the cache must be float32 \[N, block_size, 4, 1, 128\] for 2 KV heads",
        ),
        ({"cache": jnp.zeros((8, 4, 4, 1, 128), jnp.bfloat16)}, r"got bfloat16"),
        ({"kv_lens": jnp.zeros((6,), jnp.float32)}, r"kv_lens must be 1-D int32; got float32"),
        ({"cu_q_lens": jnp.zeros((6,), jnp.int32)}, r"needs kv_lens \[S\] \(S >= 1\), cu_q_lens \[S \+ 1\]"),
        ({"page_indices": jnp.zeros((7,), jnp.int32)}, r"page_indices \[S \* P\] \(P >= 1\)"),
        ({"distribution": jnp.zeros((2,), jnp.int32)}, r"distribution \[3\]"),
        ({"sliding_window": 0}, r"sliding_window must be >= 1 or None; got 0"),
        ({"soft_cap": -1.0}, r"soft_cap must be > 0 or None; got -1.0"),
        ({"sinks": jnp.zeros((2,))}, r"sinks must be \[Hq\] = \[4\]; got \(2,\)"),
    ],
)
def test_attend_rejects_bad_arguments(change, match):
  _, args = _attend_args()
  kwargs = {**args, "num_kv_heads": 2, "sm_scale": 0.3, **change}
  with pytest.raises(ValueError, match=match):
    cpu_attention.attend(**kwargs)
