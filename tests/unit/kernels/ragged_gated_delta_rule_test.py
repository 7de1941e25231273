"""Tests for ragged_gated_delta_rule against a float64 NumPy reference written here (loops over tokens)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels import ragged_conv1d
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.kernels import ragged_gated_delta_rule as gdr

# (tokens already seen, new tokens, state slot): decodes, a new prefill whose slot holds a stale state, a
# chunked prefill continuing from its stored state, a one-token new request.
REQUESTS = ((5, 1, 3), (2, 1, 5), (0, 4, 2), (6, 3, 7), (0, 1, 4))


@dataclasses.dataclass
class GdnBatch:
  """One GDN batch (NumPy arrays, kernel argument order)."""

  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  b: np.ndarray
  a: np.ndarray
  a_log: np.ndarray
  dt_bias: np.ndarray
  state: np.ndarray  # [M, nv, dk, dv] float32
  state_indices: np.ndarray
  query_start_loc: np.ndarray
  seq_lens: np.ndarray
  distribution: np.ndarray

  def args(self):
    """The kernel's positional arguments as JAX arrays."""
    return tuple(jnp.asarray(getattr(self, f.name)) for f in dataclasses.fields(self))


def _make_batch(
    seed, requests=REQUESTS, *, nk=2, nv=4, dk=8, dv=6, num_slots=9, num_tokens=16, max_reqs=7, dtype=np.float32
) -> GdnBatch:
  rng = np.random.default_rng(seed)
  qsl = np.zeros(max_reqs + 1, np.int32)
  seq_lens = np.zeros(max_reqs, np.int32)
  slots = np.zeros(max_reqs, np.int32)
  for i, (prior, new, slot) in enumerate(requests):
    qsl[i + 1] = qsl[i] + new
    seq_lens[i] = prior + new
    slots[i] = slot
  qsl[len(requests) + 1 :] = qsl[len(requests)]
  num_decode = 0
  while num_decode < len(requests) and requests[num_decode][1] == 1:
    num_decode += 1
  return GdnBatch(
      q=rng.normal(size=(num_tokens, nk, dk)).astype(dtype),
      k=rng.normal(size=(num_tokens, nk, dk)).astype(dtype),
      v=rng.normal(size=(num_tokens, nv, dv)).astype(dtype),
      b=rng.normal(size=(num_tokens, nv)).astype(dtype),
      a=rng.normal(size=(num_tokens, nv)).astype(dtype),
      a_log=rng.uniform(-1.0, 1.0, size=(nv,)).astype(np.float32),
      dt_bias=rng.uniform(-1.0, 1.0, size=(nv,)).astype(np.float32),
      state=rng.normal(size=(num_slots, nv, dk, dv)).astype(np.float32),  # every slot garbage, slot 0 too
      state_indices=slots,
      query_start_loc=qsl,
      seq_lens=seq_lens,
      distribution=np.array([num_decode, num_decode, len(requests)], np.int32),
  )


def _reference(g: GdnBatch, read=None):
  """Float64 loops in the delta-rule form: S = e S; S += k (x) beta (v - k^T S); o = q^T S. `read` (default: the
  state slots) names the slot each request's initial state comes from; the null slot 0 means zeros."""
  read_given = read is not None
  read = g.state_indices if read is None else read
  nk, dk = g.q.shape[1:]
  nv = g.v.shape[1]
  out = np.zeros(g.v.shape)
  new_state = g.state.astype(np.float64).copy()
  for r in range(g.distribution[2]):
    qs, qe = g.query_start_loc[r], g.query_start_loc[r + 1]
    slot = g.state_indices[r]
    for h in range(nv):
      kh = h // (nv // nk)
      restored = g.seq_lens[r] - (qe - qs) > 0 and (not read_given or read[r] != 0)
      s = g.state[read[r], h].astype(np.float64) if restored else np.zeros(g.state.shape[2:])
      for t in range(qs, qe):
        q = g.q[t, kh].astype(np.float64)
        k = g.k[t, kh].astype(np.float64)
        q = q / np.sqrt(np.sum(q * q) + 1e-6) / np.sqrt(dk)
        k = k / np.sqrt(np.sum(k * k) + 1e-6)
        beta = 1.0 / (1.0 + np.exp(-float(g.b[t, h])))
        decay = np.exp(-np.exp(float(g.a_log[h])) * np.log1p(np.exp(float(g.a[t, h]) + float(g.dt_bias[h]))))
        s = decay * s
        s = s + np.outer(k, beta * (g.v[t, h].astype(np.float64) - k @ s))
        out[t, h] = q @ s
      new_state[slot, h] = s
  return out, new_state


@functools.lru_cache(maxsize=None)
def _jitted():
  return jax.jit(gdr.ragged_gated_delta_rule)


def _check(g: GdnBatch, tol):
  out, new_state = _jitted()(*g.args())
  ref_out, ref_state = _reference(g)
  valid = g.query_start_loc[g.distribution[2]]
  assert out.dtype == g.v.dtype and new_state.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float64)[:valid], ref_out[:valid], atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.asarray(out, np.float64)[valid:], 0.0)
  np.testing.assert_allclose(np.asarray(new_state, np.float64), ref_state, atol=1e-5, rtol=1e-5)
  # Slots nobody owns (the null slot 0 included) are bit-for-bit untouched.
  owned = set(g.state_indices[: g.distribution[2]].tolist())
  for slot in range(g.state.shape[0]):
    if slot not in owned:
      np.testing.assert_array_equal(np.asarray(new_state)[slot], g.state[slot])


@pytest.mark.parametrize(
    "nk, nv, dtype, tol",
    [(2, 4, np.float32, 1e-5), (1, 3, np.float32, 1e-5), (2, 2, np.float32, 1e-5), (2, 4, jnp.bfloat16, 2e-2)],
)
def test_mixed_batch_matches_reference(nk, nv, dtype, tol):
  """Decodes, new and chunked prefills, padded tokens/requests, GQA head repeats, per dtype."""
  _check(_make_batch(0, nk=nk, nv=nv, dtype=dtype), tol)


def test_decode_only_batch():
  """One token per request, every request continuing from its slot."""
  _check(_make_batch(1, ((3, 1, 1), (7, 1, 6), (1, 1, 8)), num_tokens=4, max_reqs=4), 1e-5)


def test_zero_requests_precompile_dummy():
  """The precompile metadata: nothing is read or written, the output is zero."""
  g = _make_batch(2, ((3, 2, 1),), num_tokens=8, max_reqs=4)
  g = dataclasses.replace(
      g,
      state_indices=np.zeros(4, np.int32),
      query_start_loc=np.ones(5, np.int32),
      seq_lens=np.ones(4, np.int32),
      distribution=np.zeros(3, np.int32),
  )
  out, new_state = _jitted()(*g.args())
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  np.testing.assert_array_equal(np.asarray(new_state), g.state)


def test_conv_then_rule_chunked_equals_one_shot():
  """conv1d + delta rule: a 4-token prefill then 5 decodes, carrying both states, equals one 9-token prefill."""
  nk, nv, dk, dv, width, total, slot = 1, 2, 4, 3, 4, 9, 2
  channels = 2 * nk * dk + nv * dv
  rng = np.random.default_rng(3)
  mixed = rng.normal(size=(total, channels)).astype(np.float32)
  b = rng.normal(size=(total, nv)).astype(np.float32)
  a = rng.normal(size=(total, nv)).astype(np.float32)
  weight = jnp.asarray(rng.normal(size=(channels, 1, width)).astype(np.float32))
  a_log, dt_bias = jnp.asarray([0.3, -0.5]), jnp.asarray([0.1, 0.2])
  conv0 = jnp.asarray(rng.normal(size=(4, width - 1, channels)).astype(np.float32))
  rec0 = jnp.asarray(rng.normal(size=(4, nv, dk, dv)).astype(np.float32))

  @jax.jit
  def step(x, b, a, conv, rec, qsl, seq_lens):
    idx, dist = jnp.array([slot, 0]), jnp.array([0, 0, 1])
    y, conv = ragged_conv1d.ragged_conv1d(x, conv, weight, None, idx, qsl, seq_lens, dist)
    q = y[:, : nk * dk].reshape(-1, nk, dk)
    k = y[:, nk * dk : 2 * nk * dk].reshape(-1, nk, dk)
    v = y[:, 2 * nk * dk :].reshape(-1, nv, dv)
    out, rec = gdr.ragged_gated_delta_rule(q, k, v, b, a, a_log, dt_bias, rec, idx, qsl, seq_lens, dist)
    return out, conv, rec

  def run(start, count, conv, rec):
    def pad(x):
      return np.pad(x[start : start + count], [(0, total - count), (0, 0)])

    qsl = jnp.array([0, count, count])
    return step(pad(mixed), pad(b), pad(a), conv, rec, qsl, jnp.array([start + count, 0]))

  one_out, one_conv, one_rec = run(0, total, conv0, rec0)
  conv, rec, outs = conv0, rec0, []
  for start, count in [(0, 4)] + [(t, 1) for t in range(4, total)]:
    out, conv, rec = run(start, count, conv, rec)
    outs.append(np.asarray(out)[:count])
  np.testing.assert_allclose(np.concatenate(outs), np.asarray(one_out), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(conv), np.asarray(one_conv))
  np.testing.assert_allclose(np.asarray(rec), np.asarray(one_rec), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(rec)[[0, 1, 3]], np.asarray(rec0)[[0, 1, 3]])


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("q", np.zeros((16, 2)), ValueError, r"q and k must both be \[T, nk, dk\]; got q \(16, 2\)"),
        ("k", np.zeros((16, 2, 4)), ValueError, r"q and k must both be \[T, nk, dk\]"),
        ("v", np.zeros((15, 4, 6)), ValueError, r"v must be \[T, nv, dv\] with T = 16; got \(15, 4, 6\)"),
        ("v", np.zeros((16, 3, 6)), ValueError, r"nv \(3\) must be a multiple of nk \(2\)"),
        ("b", np.zeros((16, 3)), ValueError, r"b must be \[T, nv\] = \(16, 4\); got \(16, 3\)"),
        ("a", np.zeros((16,)), ValueError, r"a must be \[T, nv\]"),
        ("a_log", np.zeros((3,)), ValueError, r"A_log must be \[nv\] = \(4,\); got \(3,\)"),
        ("dt_bias", np.zeros((4, 1)), ValueError, r"dt_bias must be \[nv\]"),
        ("state", np.zeros((9, 4, 8, 5), np.float32), ValueError, r"\[M, 4, 8, 6\]; got \(9, 4, 8, 5\) float32"),
        ("state", np.zeros((9, 4, 8, 6), jnp.bfloat16), TypeError, "recurrent_state must be float32 .* got bfloat16"),
        ("state_indices", np.zeros((7, 2), np.int32), ValueError, r"state_indices must be \[S\]"),
        ("seq_lens", np.zeros((8,), np.int32), ValueError, r"seq_lens must be \[S\] = \(7,\)"),
        ("query_start_loc", np.zeros((7,), np.int32), ValueError, r"ragged_gated_delta_rule: query_start_loc must"),
        ("distribution", np.zeros((3, 1), np.int32), ValueError, r"distribution must have shape \(3,\)"),
    ],
)
def test_rejects_bad_arguments(field, value, error, match):
  """Static shape/dtype checks name the argument and the expected shape."""
  g = dataclasses.replace(_make_batch(4), **{field: value})
  with pytest.raises(error, match=match):
    gdr.ragged_gated_delta_rule(*g.args())


def test_read_and_write_slots_differ():
  """Prefix caching's split: a request resumes from one state block and checkpoints into another; a request whose
  read slot is the null slot restored nothing and starts from zeros although it has earlier tokens."""
  g = _make_batch(7, ((5, 1, 3), (4, 3, 5), (6, 2, 2), (0, 4, 7)), num_tokens=12, max_reqs=6)
  read = np.array([1, 4, 0, 6, 0, 0], np.int32)
  out, new_state = jax.jit(gdr.ragged_gated_delta_rule)(*g.args(), jnp.asarray(read))
  ref_out, ref_state = _reference(g, read)
  valid = g.query_start_loc[g.distribution[2]]
  np.testing.assert_allclose(np.asarray(out, np.float64)[:valid], ref_out[:valid], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(new_state, np.float64), ref_state, atol=1e-5, rtol=1e-5)
  for slot in (1, 4, 6):  # read, never written
    np.testing.assert_array_equal(np.asarray(new_state)[slot], g.state[slot])


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_decodes_with_split_read_and_write_slots(num_tokens):
  """The all-decode path (one token per request, no loop over tokens) honours read slots as the scan does: a
  restored slot is read and left as it was, the null read slot starts from zeros; T = 1 takes it statically."""
  requests = ((5, 1, 3), (4, 1, 5), (6, 1, 2))[:num_tokens]
  g = _make_batch(8, requests, num_tokens=num_tokens, max_reqs=4)
  read = np.array([1, 0, 6, 0], np.int32)
  out, new_state = jax.jit(gdr.ragged_gated_delta_rule)(*g.args(), jnp.asarray(read))
  ref_out, ref_state = _reference(g, read)
  valid = g.query_start_loc[g.distribution[2]]
  np.testing.assert_allclose(np.asarray(out, np.float64)[:valid], ref_out[:valid], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[valid:], 0.0)
  np.testing.assert_allclose(np.asarray(new_state, np.float64), ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA")
@pytest.mark.parametrize(
    "requests, num_tokens, max_reqs, read, nk",
    [
        (((5, 1, 3),), 1, 4, None, 2),  # one decode
        (((3, 1, 1), (7, 1, 6), (1, 1, 8)), 4, 4, None, 2),  # decodes and a padding token
        (((5, 1, 3), (4, 1, 5), (6, 1, 2)), 4, 4, [1, 0, 6, 0], 2),  # split read slots, the null slot: zeros
        (((5, 1, 3), (4, 1, 5), (6, 1, 2)), 4, 4, [5, 2, 3, 0], 2),  # each reads a slot another request writes
        (REQUESTS, 16, 7, None, 2),  # decodes, new and chunked prefills, a stale slot, padded requests
        (REQUESTS, 16, 7, None, 1),  # one key head for four value heads
        (((4, 3, 5), (6, 2, 2), (0, 4, 7)), 12, 6, [1, 4, 0, 0, 0, 0], 2),  # prefills resuming from other slots
    ],
)
def test_the_cpu_kernel_runs_the_recurrence_as_the_reference(requests, num_tokens, max_reqs, read, nk):
  """On the cpu backend the recurrence runs on the kernel (`cpu_gated_delta`): no loop over tokens and no conditional
  in XLA, the reference's outputs and states, and slots no request writes left bit for bit; the reference op never
  calls it."""
  g = _make_batch(9, requests, nk=nk, num_tokens=num_tokens, max_reqs=max_reqs)
  args = g.args() + (() if read is None else (jnp.asarray(np.array(read, np.int32)),))
  recurrence = CpuBackend().gated_delta_rule
  jaxpr = str(jax.make_jaxpr(recurrence)(*args))
  out, new_state = jax.jit(recurrence)(*args)
  assert "maxtext_gated_delta" not in str(jax.make_jaxpr(gdr.ragged_gated_delta_rule)(*args))
  assert "maxtext_gated_delta" in jaxpr and "scan" not in jaxpr and "cond" not in jaxpr
  ref_out, ref_state = _reference(g, None if read is None else np.array(read, np.int32))
  valid = g.query_start_loc[g.distribution[2]]
  np.testing.assert_allclose(np.asarray(out, np.float64)[:valid], ref_out[:valid], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[valid:], 0.0)
  np.testing.assert_allclose(np.asarray(new_state, np.float64), ref_state, atol=1e-5, rtol=1e-5)
  written = set(g.state_indices[: g.distribution[2]].tolist())
  for slot in sorted(set(range(g.state.shape[0])) - written):
    np.testing.assert_array_equal(np.asarray(new_state)[slot], g.state[slot])
