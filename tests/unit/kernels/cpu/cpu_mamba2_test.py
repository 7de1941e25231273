"""The CPU kernel's Mamba2 recurrence over a ragged batch (`cpu_mamba2`) against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import cpu_gemm, cpu_mamba2

pytestmark = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


def _operands(seed, num_tokens, heads, head_dim, groups, state_dim, slots):
  rng = np.random.default_rng(seed)
  return (
      rng.normal(size=(num_tokens, heads, head_dim)).astype(np.float32),  # x
      rng.uniform(0.01, 0.5, size=(num_tokens, heads)).astype(np.float32),  # delta
      rng.uniform(0.5, 1.0, size=(num_tokens, heads)).astype(np.float32),  # decay
      rng.normal(size=(num_tokens, groups, state_dim)).astype(np.float32),  # B
      rng.normal(size=(num_tokens, groups, state_dim)).astype(np.float32),  # C
      rng.normal(size=(heads,)).astype(np.float32),  # D
      rng.normal(size=(slots, heads, head_dim, state_dim)).astype(np.float32),
  )


def _reference(x, delta, decay, b, c, skip, states, qsl, read, write, real):
  """Float64 loops over requests, heads and tokens: every request starts from the states as given; writes in
  request order (the last one stays)."""
  slots, heads = states.shape[:2]
  per_group = heads // b.shape[1]
  before = states.astype(np.float64)
  after = before.copy()
  y = np.zeros(x.shape)
  for r in range(real):
    if qsl[r + 1] == qsl[r]:
      continue
    for h in range(heads):
      s = before[read[r], h] if 0 <= read[r] < slots else np.zeros(states.shape[2:])
      g = h // per_group
      for t in range(qsl[r], qsl[r + 1]):
        xt = x[t, h].astype(np.float64)
        s = float(decay[t, h]) * s + np.outer(float(delta[t, h]) * xt, b[t, g].astype(np.float64))
        y[t, h] = s @ c[t, g].astype(np.float64) + float(skip[h]) * xt
      if 0 <= write[r] < slots:
        after[write[r], h] = s
  return y, after


def _run(operands, qsl, read, write, real):
  meta = [jnp.asarray(np.array(a, np.int32)) for a in (qsl, read, write, [0, 0, real])]
  x, delta, decay, b, c, skip, states = map(jnp.asarray, operands)
  return jax.jit(cpu_mamba2.mamba2)(x, delta, decay, b, c, skip, *meta, states)


@pytest.mark.parametrize(
    "tokens, heads, head_dim, groups, state_dim, qsl, read, write, real",
    [
        (1, 8, 64, 1, 128, [0, 1], [3], [3], 1),  # a decode: in place
        (5, 4, 8, 2, 12, [0, 1, 2, 3, 4, 4], [1, -1, 5, 2, 0], [1, 4, 9, 2, 0], 4),  # no state; a write out of range
        (3, 2, 16, 2, 20, [0, 1, 2, 3], [2, 3, 1], [3, 1, 2], 3),  # each request reads a slot another one writes
        (3, 3, 8, 1, 13, [0, 1, 2, 3], [1, 1, 1], [4, 4, 2], 3),  # two write one slot (the later stays)
        (12, 4, 8, 4, 16, [0, 5, 5, 9, 12], [2, 7, -1, 3], [2, 7, 5, 6], 3),  # prefills, no tokens, padding
        (64, 8, 32, 2, 64, [0, 40, 41, 64], [1, 2, -1], [5, 2, 7], 3),  # shared with the helper threads
    ],
)
def test_mamba2_matches_float64(tokens, heads, head_dim, groups, state_dim, qsl, read, write, real):
  operands = _operands(tokens + state_dim, tokens, heads, head_dim, groups, state_dim, slots=9)
  assert cpu_gemm.load()
  y, states = _run(operands, qsl, read, write, real)
  ref_y, ref_states = _reference(*operands, qsl, read, write, real)
  np.testing.assert_allclose(np.asarray(y, np.float64), ref_y, atol=5e-5, rtol=5e-5)
  np.testing.assert_array_equal(np.asarray(y)[qsl[real] :], 0.0)  # tokens of no request
  np.testing.assert_allclose(np.asarray(states, np.float64), ref_states, atol=5e-5, rtol=5e-5)
  written = {write[r] for r in range(real) if qsl[r + 1] > qsl[r]}
  untouched = sorted(set(range(9)) - written)
  np.testing.assert_array_equal(np.asarray(states)[untouched], operands[6][untouched])


def test_donated_states_are_updated_in_place():
  """The states are the call's second result's buffer: a jitted step that donates them compiles with that alias."""
  operands = [jnp.asarray(a) for a in _operands(0, 2, 2, 8, 1, 8, slots=4)]
  meta = [jnp.array(a, jnp.int32) for a in ([0, 1, 2], [1, 2], [1, 3], [0, 0, 2])]
  assert cpu_gemm.load()
  step = jax.jit(lambda *a: cpu_mamba2.mamba2(*a[:6], *meta, a[6]), donate_argnums=(6,))
  hlo = step.lower(*operands).compile().as_text()
  assert "output_to_operand_aliasing={{1}: (10, {})}" in hlo
  expected = _reference(*map(np.asarray, operands), [0, 1, 2], [1, 2], [1, 3], 2)[1]
  np.testing.assert_allclose(np.asarray(step(*operands)[1]), expected, atol=5e-5, rtol=5e-5)


_NAMES = ("x", "delta", "decay", "b", "c", "skip", "query_start_loc", "read", "write", "distribution", "states")


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("x", np.zeros((2, 2), np.float32), r"x \[T, H, hd\], B \[T, G, N\] and read \[S\]; got x \(2, 2\)"),
        ("b", np.zeros((3, 3, 5), np.float32), r"heads of x \(4\) must be a multiple of B's groups \(3\)"),
        ("delta", np.zeros((3,), np.float32), r"delta has shape \(3,\), expected \(3, 4\)"),
        ("c", np.zeros((3, 2, 4), np.float32), r"c has shape \(3, 2, 4\), expected \(3, 2, 5\)"),
        ("skip", np.zeros((2,), np.float32), r"skip has shape \(2,\), expected \(4,\)"),
        ("query_start_loc", np.zeros((2,), np.int32), r"query_start_loc has shape \(2,\), expected \(3,\)"),
        ("write", np.zeros((3,), np.int32), r"write has shape \(3,\), expected \(2,\)"),
        ("states", np.zeros((6, 4, 6, 4), np.float32), r"states has shape \(6, 4, 6, 4\), expected \(6, 4, 6, 5\)"),
        ("decay", np.zeros((3, 4), np.float64), r"mamba2 takes float32 values and int32 metadata; decay is float64"),
        ("read", np.zeros((2,), np.float32), r"read is float32"),
    ],
)
def test_mamba2_names_the_operand_that_does_not_fit(name, value, match):
  operands = dict(zip(_NAMES[:6], _operands(1, 3, 4, 6, 2, 5, slots=6)[:6]))
  operands.update(
      query_start_loc=np.array([0, 1, 3], np.int32),
      read=np.zeros((2,), np.int32),
      write=np.zeros((2,), np.int32),
      distribution=np.array([0, 0, 2], np.int32),
      states=np.zeros((6, 4, 6, 5), np.float32),
  )
  operands[name] = value
  with pytest.raises(ValueError, match=match):
    cpu_mamba2.mamba2(*(jnp.asarray(operands[n]) if n != "decay" else operands[n] for n in _NAMES))
