"""ragged_mamba2 on the CPU kernel (`cpu_mamba2`) against its XLA scan and a float64 NumPy reference written here."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.kernels.ragged_mamba2 import ragged_mamba2

pytestmark = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)

NH, HD, G, N, SLOTS = 4, 8, 2, 6, 9
LIMIT = (0.05, 1.5)


def _batch(seed, qsl, seq_lens, slots, real, num_tokens, read=None):
  rng = np.random.default_rng(seed)
  arrays = {
      "x": rng.normal(size=(num_tokens, NH, HD)),
      "dt": rng.normal(size=(num_tokens, NH)),
      "b": rng.normal(size=(num_tokens, G, N)),
      "c": rng.normal(size=(num_tokens, G, N)),
      "A_log": rng.normal(size=(NH,)) * 0.5,
      "D": rng.normal(size=(NH,)),
      "dt_bias": rng.normal(size=(NH,)) * 0.5,
      "ssm_state": rng.normal(size=(SLOTS, NH, HD, N)),
  }
  args = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}
  meta = {"state_indices": slots, "query_start_loc": qsl, "seq_lens": seq_lens, "distribution": [0, 0, real]}
  args.update({k: jnp.asarray(np.array(v, np.int32)) for k, v in meta.items()})
  if read is not None:
    args["read_state_indices"] = jnp.asarray(np.array(read, np.int32))
  return args


def _reference(args):
  """Float64 loops: each real request starts from its read slot's state (zeros for a new request or the null read
  slot 0), runs its tokens, and its final state goes to its slot."""
  a = {k: np.asarray(v, np.float64) if v.dtype == jnp.float32 else np.asarray(v) for k, v in args.items()}
  qsl, seq_lens, slots, real = a["query_start_loc"], a["seq_lens"], a["state_indices"], a["distribution"][2]
  read = a.get("read_state_indices", slots)
  state, y = a["ssm_state"].copy(), np.zeros(a["x"].shape)
  before = a["ssm_state"]
  for r in range(real):
    new = seq_lens[r] - (qsl[r + 1] - qsl[r])
    s = before[read[r]].copy() if new > 0 and ("read_state_indices" not in a or read[r] != 0) else np.zeros((NH, HD, N))
    for t in range(qsl[r], qsl[r + 1]):
      delta = np.clip(np.logaddexp(0.0, a["dt"][t] + a["dt_bias"]), *LIMIT)  # softplus, clamped
      decay = np.exp(-np.exp(a["A_log"]) * delta)
      for h in range(NH):
        g = h // (NH // G)
        s[h] = decay[h] * s[h] + np.outer(delta[h] * a["x"][t, h], a["b"][t, g])
        y[t, h] = s[h] @ a["c"][t, g] + a["D"][h] * a["x"][t, h]
    if qsl[r + 1] > qsl[r]:
      state[slots[r]] = s
  return y, state


@pytest.mark.parametrize(
    "qsl, seq_lens, slots, real, num_tokens, read",
    [
        ([0, 1], [7], [3], 1, 1, None),  # one decode
        ([0, 1, 2, 3, 3], [5, 9, 2, 0], [3, 5, 1, 0], 3, 4, None),  # decodes and a padding token
        ([0, 1, 2, 3], [5, 4, 6], [3, 5, 2], 3, 3, [5, 2, 3]),  # each reads a slot another request writes
        ([0, 1, 2, 3], [5, 4, 6], [3, 5, 2], 3, 3, [1, 0, 6]),  # split read slots; the null read slot: zeros
        ([0, 5, 5, 9, 12, 12], [11, 3, 4, 3, 0], [2, 4, 1, 6, 0], 4, 14, None),  # prefills, no tokens, padding
    ],
)
def test_the_kernel_runs_the_recurrence_as_the_scan_and_the_reference(qsl, seq_lens, slots, real, num_tokens, read):
  """On the cpu backend the recurrence runs on the kernel: no loop over tokens and no conditional in XLA, the XLA
  scan's and the float64 reference's outputs and states, and slots no request writes left bit for bit."""
  args = _batch(len(qsl) + num_tokens, qsl, seq_lens, slots, real, num_tokens, read)
  op = functools.partial(ragged_mamba2, time_step_limit=LIMIT)
  names = list(inspect.signature(ragged_mamba2).parameters)[:12]  # x ... distribution
  backend = CpuBackend()

  def on_cpu(*operands):
    return backend.mamba2_scan(*operands, LIMIT, args.get("read_state_indices"))

  operands = [args[name] for name in names]
  jaxpr = str(jax.make_jaxpr(on_cpu)(*operands))
  y, state = jax.jit(on_cpu)(*operands)
  assert "maxtext_mamba2" not in str(jax.make_jaxpr(op)(**args))
  assert "maxtext_mamba2" in jaxpr and "scan" not in jaxpr and "cond" not in jaxpr
  scan_y, scan_state = jax.jit(op)(**args)
  ref_y, ref_state = _reference(args)
  valid = qsl[real]
  np.testing.assert_allclose(np.asarray(y, np.float64)[:valid], ref_y[:valid], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(y)[:valid], np.asarray(scan_y)[:valid], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(y)[valid:], 0.0)
  np.testing.assert_allclose(np.asarray(state, np.float64), ref_state, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(state), np.asarray(scan_state), atol=2e-5, rtol=2e-5)
  written = {slots[r] for r in range(real) if qsl[r + 1] > qsl[r]}
  for slot in sorted(set(range(SLOTS)) - written):
    np.testing.assert_array_equal(np.asarray(state)[slot], np.asarray(args["ssm_state"])[slot])
