"""Tests for ragged_conv1d against a float64 NumPy reference written here (loops over requests and tokens)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.kernels import ragged_conv1d as rc

# (tokens already seen, new tokens, state slot): decodes, a decode with fewer than K - 1 earlier tokens, a new
# request shorter than K - 1 (its slot holds stale rows that must be ignored), a chunked prefill, a new prefill.
REQUESTS = ((5, 1, 3), (1, 1, 5), (0, 2, 2), (6, 5, 7), (0, 6, 1))


def _silu(x):
  return x / (1.0 + np.exp(-x))


@dataclasses.dataclass
class ConvBatch:
  """One conv batch (NumPy arrays, kernel argument order)."""

  x: np.ndarray  # [T, C]
  conv_state: np.ndarray  # [M, K - 1, C] in its dtype
  weight: np.ndarray  # [C, 1, K]
  bias: np.ndarray | None
  state_indices: np.ndarray
  query_start_loc: np.ndarray
  seq_lens: np.ndarray
  distribution: np.ndarray

  def args(self):
    """The kernel's positional arguments as JAX arrays."""
    return (
        jnp.asarray(self.x),
        jnp.asarray(self.conv_state),
        jnp.asarray(self.weight),
        None if self.bias is None else jnp.asarray(self.bias),
        jnp.asarray(self.state_indices),
        jnp.asarray(self.query_start_loc),
        jnp.asarray(self.seq_lens),
        jnp.asarray(self.distribution),
    )


def _make_batch(
    seed,
    requests=REQUESTS,
    *,
    channels=6,
    width=4,
    num_slots=9,
    num_tokens=20,
    max_reqs=7,
    x_dtype=np.float32,
    state_dtype=np.float32,
    with_bias=True,
) -> ConvBatch:
  rng = np.random.default_rng(seed)
  qsl = np.zeros(max_reqs + 1, np.int32)
  seq_lens = np.zeros(max_reqs, np.int32)
  slots = np.zeros(max_reqs, np.int32)  # padded requests point at the null slot 0
  for i, (prior, new, slot) in enumerate(requests):
    qsl[i + 1] = qsl[i] + new
    seq_lens[i] = prior + new
    slots[i] = slot
  qsl[len(requests) + 1 :] = qsl[len(requests)]
  assert qsl[-1] <= num_tokens
  return ConvBatch(
      x=rng.normal(size=(num_tokens, channels)).astype(x_dtype),  # the padded tail is garbage too
      conv_state=rng.normal(size=(num_slots, width - 1, channels)).astype(state_dtype),  # every slot garbage
      weight=rng.normal(size=(channels, 1, width)).astype(np.float32),
      bias=rng.normal(size=(channels,)).astype(np.float32) if with_bias else None,
      state_indices=slots,
      query_start_loc=qsl,
      seq_lens=seq_lens,
      distribution=np.array([0, 0, len(requests)], np.int32),
  )


def _reference(b: ConvBatch, read=None):
  """Float64 loops; `read` (default: the state slots) names the slot each request's stored rows come from."""
  read = b.state_indices if read is None else read
  width = b.weight.shape[2]
  old = b.conv_state.astype(np.float64)
  new_state = old.copy()
  x = b.x.astype(np.float64)
  w = b.weight[:, 0, :].astype(np.float64)  # [C, K]
  y = np.zeros(x.shape)
  for r in range(b.distribution[2]):
    qs, qe = b.query_start_loc[r], b.query_start_loc[r + 1]
    slot = b.state_indices[r]
    restored = b.seq_lens[r] - (qe - qs) > 0 and (read is b.state_indices or read[r] != 0)
    hist = old[read[r]] if restored else np.zeros_like(old[slot])
    stream = np.concatenate([hist, x[qs:qe]])  # [K - 1 + ql, C]
    for j in range(qe - qs):
      window = stream[j : j + width]  # x_{t-K+1} .. x_t
      acc = np.sum(window * w.T, axis=0)
      if b.bias is not None:
        acc = acc + b.bias
      y[qs + j] = _silu(acc)
    new_state[slot] = stream[-(width - 1) :].astype(b.conv_state.dtype).astype(np.float64)
  return y, new_state


@functools.lru_cache(maxsize=None)
def _jitted():
  return jax.jit(rc.ragged_conv1d)


def _check(b: ConvBatch, tol):
  y, new_state = _jitted()(*b.args())
  ref_y, ref_state = _reference(b)
  valid = b.query_start_loc[b.distribution[2]]
  assert y.dtype == b.x.dtype and new_state.dtype == b.conv_state.dtype
  np.testing.assert_allclose(np.asarray(y, np.float64)[:valid], ref_y[:valid], atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.asarray(y, np.float64)[valid:], 0.0)
  # Written slots hold the new raw rows; every other slot (the null slot 0 included) is untouched.
  np.testing.assert_array_equal(np.asarray(new_state).astype(np.float64), ref_state)


@pytest.mark.parametrize(
    "x_dtype, state_dtype, tol",
    [(np.float32, np.float32, 1e-5), (np.float32, jnp.bfloat16, 1e-5), (jnp.bfloat16, jnp.bfloat16, 2e-2)],
)
def test_mixed_batch_matches_reference(x_dtype, state_dtype, tol):
  """Decodes, short and chunked prefills, stale slots, padding, per dtype pair."""
  _check(_make_batch(0, x_dtype=x_dtype, state_dtype=state_dtype), tol)


def test_without_bias_and_other_width():
  """No bias, and conv widths 2 and 5."""
  _check(_make_batch(1, width=2, with_bias=False, channels=5), 1e-5)
  _check(_make_batch(2, width=5, channels=3), 1e-5)


def test_decode_only_batch():
  """One token per request, every request continuing from its slot."""
  _check(_make_batch(3, ((4, 1, 2), (9, 1, 4), (2, 1, 6)), num_tokens=4, max_reqs=4), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [1, 4, 8, 9])
def test_decode_programs_sum_the_taps_without_a_dot(num_tokens):
  """On the cpu backend a step of up to 8 tokens (compiled without YNNPACK's fusions) sums the taps in one fused
  product (no dot); more tokens, and the reference op, contract them with a dot. Both match the reference."""
  requests = ((4, 1, 2), (9, 1, 4), (2, 1, 6), (0, 1, 3))[: min(num_tokens, 4)]
  b = _make_batch(7, requests, num_tokens=num_tokens, max_reqs=4)
  backend = CpuBackend()
  for conv in (backend.conv1d, rc.ragged_conv1d):
    jaxpr = str(jax.make_jaxpr(conv)(*b.args()))
    y, new_state = jax.jit(conv)(*b.args())
    sums = conv is not rc.ragged_conv1d and bool(backend.compiler_options(num_tokens))
    assert ("dot_general" in jaxpr) is not sums
    assert not sums or num_tokens <= cpu_gemm.MAX_ROWS
    ref_y, ref_state = _reference(b)
    valid = b.query_start_loc[b.distribution[2]]
    np.testing.assert_allclose(np.asarray(y, np.float64)[:valid], ref_y[:valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_state).astype(np.float64), ref_state)


def test_zero_requests_precompile_dummy():
  """The precompile metadata: nothing is read or written, the output is zero."""
  b = _make_batch(4, ((3, 2, 1),), num_tokens=8, max_reqs=4)
  b = dataclasses.replace(
      b,
      state_indices=np.zeros(4, np.int32),
      query_start_loc=np.ones(5, np.int32),
      seq_lens=np.ones(4, np.int32),
      distribution=np.zeros(3, np.int32),
  )
  y, new_state = _jitted()(*b.args())
  np.testing.assert_array_equal(np.asarray(y), 0.0)
  np.testing.assert_array_equal(np.asarray(new_state), b.conv_state)


def test_chunked_equals_one_shot():
  """A 3-token prefill (fewer than K - 1 = 4) then 5 decodes, carrying the state, equals one 8-token prefill."""
  total = 8
  one = _make_batch(5, ((0, total, 2),), width=5, num_tokens=8, max_reqs=2)
  one_y, one_state = _jitted()(*one.args())
  state = jnp.asarray(one.conv_state)
  ys = []
  for start, count in [(0, 3)] + [(t, 1) for t in range(3, total)]:
    x = np.zeros_like(one.x)
    x[:count] = one.x[start : start + count]
    step = dataclasses.replace(
        one,
        x=x,
        conv_state=state,
        query_start_loc=np.array([0, count, count], np.int32),
        seq_lens=np.array([start + count, 0], np.int32),
    )
    y, state = _jitted()(*step.args())
    ys.append(np.asarray(y)[:count])
  np.testing.assert_allclose(np.concatenate(ys), np.asarray(one_y), atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(state), np.asarray(one_state))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("x", np.zeros((4, 6, 1)), r"x must be \[T, C\]; got shape \(4, 6, 1\)"),
        ("weight", np.zeros((4, 6)), r"weight must be \[C, 1, K\] = \[6, 1, K\] with K >= 2; got \(4, 6\)"),
        ("weight", np.zeros((6, 1, 1)), r"with K >= 2; got \(6, 1, 1\)"),
        ("conv_state", np.zeros((9, 4, 6)), r"conv_state must be \[M, K - 1, C\] = \[M, 3, 6\]; got \(9, 4, 6\)"),
        ("conv_state", np.zeros((3, 6)), r"conv_state must be \[M, K - 1, C\]"),
        ("bias", np.zeros((5,)), r"bias must be \[C\] = \(6,\) or None; got \(5,\)"),
        ("state_indices", np.zeros((7, 1), np.int32), r"state_indices must be \[S\]; got shape \(7, 1\)"),
        ("seq_lens", np.zeros((6,), np.int32), r"seq_lens must be \[S\] = \(7,\) like state_indices; got \(6,\)"),
        ("query_start_loc", np.zeros((7,), np.int32), r"ragged_conv1d: query_start_loc must have shape"),
        ("distribution", np.zeros((2,), np.int32), r"distribution must have shape \(3,\)"),
    ],
)
def test_rejects_bad_arguments(field, value, match):
  """Static shape checks name the argument and the expected shape."""
  b = dataclasses.replace(_make_batch(6), **{field: value})
  with pytest.raises(ValueError, match=match):
    rc.ragged_conv1d(*b.args())


def test_read_and_write_slots_differ():
  """Prefix caching's split: each request reads its stored rows from one slot and writes to another; a request
  whose read slot is the null slot restored nothing and starts from zeros although it has earlier tokens."""
  b = _make_batch(5, ((4, 1, 1), (8, 3, 2), (6, 2, 3), (0, 4, 4)), num_tokens=12, max_reqs=6)
  read = np.array([5, 6, 0, 7, 0, 0], np.int32)
  y, new_state = jax.jit(rc.ragged_conv1d)(*b.args(), jnp.asarray(read))
  ref_y, ref_state = _reference(b, read)
  valid = b.query_start_loc[b.distribution[2]]
  np.testing.assert_allclose(np.asarray(y, np.float64)[:valid], ref_y[:valid], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(new_state).astype(np.float64), ref_state)
  # The read slots are untouched.
  for slot in (5, 6, 7):
    np.testing.assert_array_equal(np.asarray(new_state)[slot], b.conv_state[slot])


def test_read_slots_must_be_per_request():
  b = _make_batch(6)
  with pytest.raises(ValueError, match=r"read_state_indices must be \[S\]"):
    rc.ragged_conv1d(*b.args(), jnp.zeros((3,), jnp.int32))
