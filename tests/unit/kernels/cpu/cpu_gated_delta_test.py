"""The CPU kernel's gated delta rule over a ragged batch (`cpu_gated_delta`) against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import cpu_gated_delta, cpu_gemm

pytestmark = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


def _operands(seed, num_tokens, heads, dk, dv, slots):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(num_tokens, heads, dk)).astype(np.float32)
  k = rng.normal(size=(num_tokens, heads, dk)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  return (
      q,
      k,
      rng.normal(size=(num_tokens, heads, dv)).astype(np.float32),
      rng.uniform(0.0, 1.0, size=(num_tokens, heads)).astype(np.float32),
      rng.uniform(0.5, 1.0, size=(num_tokens, heads)).astype(np.float32),
      rng.normal(size=(slots, heads, dk, dv)).astype(np.float32),
  )


def _reference(q, k, v, beta, decay, states, qsl, read, write, real):
  """Float64 loops over requests and their tokens: every request starts from the states as given; writes in
  request order (the last one stays)."""
  slots = states.shape[0]
  before = states.astype(np.float64)
  after = before.copy()
  out = np.zeros(v.shape)
  for r in range(real):
    if qsl[r + 1] == qsl[r]:
      continue
    for h in range(q.shape[1]):
      s = before[read[r], h] if 0 <= read[r] < slots else np.zeros(states.shape[2:])
      for t in range(qsl[r], qsl[r + 1]):
        qt, kt, e = q[t, h].astype(np.float64), k[t, h].astype(np.float64), float(decay[t, h])
        v_new = float(beta[t, h]) * (v[t, h].astype(np.float64) - e * (kt @ s))
        out[t, h] = e * (qt @ s) + (qt @ kt) * v_new
        s = e * s + np.outer(kt, v_new)
      if 0 <= write[r] < slots:
        after[write[r], h] = s
  return out, after


def _run(operands, qsl, read, write, real):
  meta = [jnp.asarray(np.array(a, np.int32)) for a in (qsl, read, write, [0, 0, real])]
  q, k, v, beta, decay, states = map(jnp.asarray, operands)
  return jax.jit(cpu_gated_delta.gated_delta)(q, k, v, beta, decay, *meta, states)


@pytest.mark.parametrize(
    "tokens, heads, dk, dv, qsl, read, write, real",
    [
        (1, 8, 64, 64, [0, 1], [3], [3], 1),  # a Qwen3-Next decode: in place
        (5, 3, 8, 6, [0, 1, 2, 3, 4, 4], [1, -1, 5, 2, 0], [1, 4, 9, 2, 0], 4),  # no state; a write out of range
        (3, 2, 16, 20, [0, 1, 2, 3], [2, 3, 1], [3, 1, 2], 3),  # each request reads a slot another one writes
        (3, 2, 8, 13, [0, 1, 2, 3], [1, 1, 1], [4, 4, 2], 3),  # two write one slot (the later stays), one read thrice
        (12, 2, 8, 12, [0, 5, 5, 9, 12], [2, 7, -1, 3], [2, 7, 5, 6], 3),  # prefills, a request without tokens, padding
        (64, 4, 64, 64, [0, 40, 41, 64], [1, 2, -1], [5, 2, 7], 3),  # shared with the helper threads
    ],
)
def test_gated_delta_matches_float64(tokens, heads, dk, dv, qsl, read, write, real):
  operands = _operands(tokens + dk, tokens, heads, dk, dv, slots=9)
  assert cpu_gemm.load()
  out, states = _run(operands, qsl, read, write, real)
  ref_out, ref_states = _reference(*operands, qsl, read, write, real)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(out)[qsl[real] :], 0.0)  # tokens of no request
  np.testing.assert_allclose(np.asarray(states, np.float64), ref_states, atol=2e-5, rtol=2e-5)
  written = {write[r] for r in range(real) if qsl[r + 1] > qsl[r]}
  untouched = sorted(set(range(9)) - written)
  np.testing.assert_array_equal(np.asarray(states)[untouched], operands[5][untouched])


def test_donated_states_are_updated_in_place():
  """The states are the call's second result's buffer: a jitted step that donates them compiles with that alias."""
  operands = [jnp.asarray(a) for a in _operands(0, 2, 2, 8, 8, slots=4)]
  meta = [jnp.array(a, jnp.int32) for a in ([0, 1, 2], [1, 2], [1, 3], [0, 0, 2])]
  assert cpu_gemm.load()
  step = jax.jit(
      lambda q, k, v, beta, decay, states: cpu_gated_delta.gated_delta(q, k, v, beta, decay, *meta, states),
      donate_argnums=(5,),
  )
  hlo = step.lower(*operands).compile().as_text()
  assert "output_to_operand_aliasing={{1}: (9, {})}" in hlo
  expected = _reference(*map(np.asarray, operands), [0, 1, 2], [1, 2], [1, 3], 2)[1]
  np.testing.assert_allclose(np.asarray(step(*operands)[1]), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("q", np.zeros((2, 2), np.float32), r"q \[T, H, dk\], v \[T, H, dv\] and read \[S\]; got q \(2, 2\)"),
        ("k", np.zeros((3, 2, 7), np.float32), r"k has shape \(3, 2, 7\), expected \(3, 2, 8\)"),
        ("beta", np.zeros((3,), np.float32), r"beta has shape \(3,\), expected \(3, 2\)"),
        ("query_start_loc", np.zeros((2,), np.int32), r"query_start_loc has shape \(2,\), expected \(3,\)"),
        ("states", np.zeros((4, 2, 8, 7), np.float32), r"states has shape \(4, 2, 8, 7\), expected \(4, 2, 8, 8\)"),
        ("write", np.zeros((3,), np.int32), r"write has shape \(3,\), expected \(2,\)"),
        ("distribution", np.zeros((3,), np.float32), "int32 metadata; distribution is float32"),
        ("decay", np.zeros((3, 2), np.float16), "float32 values and int32 metadata; decay is float16"),
    ],
)
def test_gated_delta_rejects_what_does_not_match(name, value, match):
  names = ("q", "k", "v", "beta", "decay", "query_start_loc", "read", "write", "distribution", "states")
  q, k, v, beta, decay, states = _operands(0, 3, 2, 8, 8, slots=4)
  given = {"q": q, "k": k, "v": v, "beta": beta, "decay": decay, "states": states}
  given.update(query_start_loc=np.array([0, 1, 3], np.int32), read=np.zeros(2, np.int32))
  given.update(write=np.zeros(2, np.int32), distribution=np.array([0, 0, 2], np.int32))
  given[name] = value
  with pytest.raises(ValueError, match=match):
    cpu_gated_delta.gated_delta(*(jnp.asarray(given[n]) for n in names))


def test_applies_for_float32_only():
  assert cpu_gated_delta.applies(jnp.float32, jnp.float32)
  assert not cpu_gated_delta.applies(jnp.float32, jnp.bfloat16)
