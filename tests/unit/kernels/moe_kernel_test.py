"""kernels/moe.py (named apart from layers/moe_test.py: test basenames must be unique): grouped-matmul experts
(ragged_dot, tiled and the CPU kernel's rows) against experts_dense and a float64 NumPy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.kernels.backend import default_backend
from maxtext.kernels.experts import experts_dense
from maxtext.kernels.cpu.cpu_moe import experts_cpu_rows
from maxtext.kernels.moe import experts_ragged, experts_tiled, sort_by_expert, tile_rows
from maxtext.layers.mlp import clamped_swiglu

needs_cpu_kernel = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the CPU kernel needs x86-64 with AVX2 and FMA"
)
KERNELS = {
    "ragged": experts_ragged,
    "tiled": experts_tiled,
    "cpu_rows": pytest.param(experts_cpu_rows, marks=needs_cpu_kernel),
}


def _silu64(x):
  return x / (1 + np.exp(-x))


def _reference(x, weights, indices, wg, wu, wd):
  """Token by token, choice by choice, in float64."""
  x, weights, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, weights, wg, wu, wd))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j, e in enumerate(np.asarray(indices)[t]):
      h = _silu64(x[t] @ wg[e]) * (x[t] @ wu[e])
      out[t] += weights[t, j] * (h @ wd[e])
  return out


def _case(num_tokens, num_experts, top_k, seed=0, skew=False, dim=16, mlp=12):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_tokens, dim)).astype(np.float32)
  if skew:  # every token picks experts 0..k-1: one expert's run spans many tiles, the others are empty
    indices = np.tile(np.arange(top_k, dtype=np.int32), (num_tokens, 1))
  else:
    indices = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
  weights = rng.uniform(0.1, 1.0, size=(num_tokens, top_k)).astype(np.float32)
  wg, wu = (rng.normal(size=(num_experts, dim, mlp)).astype(np.float32) * 0.3 for _ in range(2))
  wd = rng.normal(size=(num_experts, mlp, dim)).astype(np.float32) * 0.3
  return x, weights, indices, wg, wu, wd


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS)
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,skew",
    [(1, 16, 2, False), (5, 4, 1, False), (8, 16, 2, False), (64, 16, 2, False), (33, 6, 3, True), (7, 3, 3, False)],
)
def test_kernel_matches_float64_reference_and_dense(kernel, num_tokens, num_experts, top_k, skew):
  x, weights, indices, wg, wu, wd = _case(num_tokens, num_experts, top_k, skew=skew)
  kw = {"activation": jax.nn.silu, "dtype": jnp.float32}
  if kernel is experts_cpu_rows:
    assert cpu_gemm.load()
  fn = jax.jit(lambda *a: kernel(*a, **kw))
  out = np.asarray(fn(x, weights, indices, wg, wu, wd))
  assert out.shape == (num_tokens, 16) and out.dtype == np.float32
  np.testing.assert_allclose(out, _reference(x, weights, indices, wg, wu, wd), atol=2e-5, rtol=1e-5)
  dense = np.asarray(experts_dense(x, weights, indices, wg, wu, wd, **kw))
  np.testing.assert_allclose(out, dense, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [experts_ragged, experts_tiled], ids=["ragged", "tiled"])
def test_kernel_in_bfloat16_is_close_to_the_float64_reference(kernel):
  x, weights, indices, wg, wu, wd = _case(12, 8, 2, seed=3)
  cast = [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]
  out = kernel(cast[0], weights, indices, *cast[1:], activation=jax.nn.silu, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  ref = _reference(
      *(np.asarray(a, np.float32) for a in (cast[0], weights)), indices, *(np.asarray(a, np.float32) for a in cast[1:])
  )
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=5e-2, rtol=5e-2)


def test_sort_by_expert_orders_rows_stably_with_group_sizes():
  indices = jnp.asarray([[2, 0], [0, 1], [2, 3]], jnp.int32)
  order, token_of_row, group_sizes = sort_by_expert(indices, 5)
  # Flat rows: 0:(t0,e2) 1:(t0,e0) 2:(t1,e0) 3:(t1,e1) 4:(t2,e2) 5:(t2,e3).
  assert order.tolist() == [1, 2, 3, 0, 4, 5]
  assert token_of_row.tolist() == [0, 1, 1, 0, 2, 2]
  assert group_sizes.tolist() == [2, 1, 2, 1, 0]


@pytest.mark.parametrize("num_rows,num_experts", [(1, 16), (2, 16), (16, 16), (128, 16), (1024, 16), (9, 4), (7, 3)])
def test_tile_bound_covers_every_routing(num_rows, num_experts):
  m, max_tiles = tile_rows(num_rows, num_experts)
  assert m == -(-num_rows // num_experts) and 1 <= max_tiles <= num_rows
  rng = np.random.default_rng(num_rows)
  worst = 0
  for _ in range(200):  # random, and maximally fragmented, splits of the rows over the experts
    sizes = np.bincount(rng.integers(0, num_experts, size=num_rows), minlength=num_experts)
    worst = max(worst, int(np.sum(-(-sizes // m))))
  fragmented = np.full(num_experts, 0)
  fragmented[: min(num_experts, num_rows)] = 1
  fragmented[0] += num_rows - fragmented.sum()
  worst = max(worst, int(np.sum(-(-fragmented // m))))
  assert worst <= max_tiles


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS)
@pytest.mark.parametrize(
    "shapes,match",
    [
        (((4, 8), (4, 2), (4, 3), (3, 8, 5), (3, 8, 5), (3, 5, 8)), r"weights, indices \[T, k\]; got x \(4, 8\)"),
        (((4, 8), (4, 2), (4, 2), (3, 8, 5), (3, 8, 5), (3, 8, 5)), r"w_down \[E, F, D\] with D = x.shape\[1\] = 8"),
        (((4, 6), (4, 2), (4, 2), (3, 8, 5), (3, 8, 5), (3, 5, 8)), r"D = x.shape\[1\] = 6; got w_gate \(3, 8, 5\)"),
    ],
)
def test_kernel_rejects_shapes_that_disagree(kernel, shapes, match):
  arrays = [jnp.zeros(s, jnp.int32 if i == 2 else jnp.float32) for i, s in enumerate(shapes)]
  with pytest.raises(ValueError, match=match):
    kernel(*arrays, activation=jax.nn.silu, dtype=jnp.float32)


def _clamped_swiglu64(gate, up, alpha=1.702, limit=0.8):
  g = np.minimum(gate, limit)
  return (np.clip(up, -limit, limit) + 1) * g / (1 + np.exp(-alpha * g))


@pytest.mark.parametrize(
    "method, cpu_kernel",
    [
        ("tiled", False),
        ("ragged", False),
        ("dense", False),
        ("gather", False),
        pytest.param("tiled", True, marks=needs_cpu_kernel, id="tiled-under-the-cpu-kernel"),
    ],
)
def test_every_method_takes_expert_biases_and_a_glu(method, cpu_kernel):
  """gpt-oss experts: biased gate/up/down and the clamped SwiGLU, in every backend method, against float64.

  The cpu backend runs the CPU kernel's rows whatever the method.
  """
  x, weights, indices, wg, wu, wd = _case(9, 5, 2, seed=3)
  rng = np.random.default_rng(4)
  bg, bu = (rng.normal(size=(5, 12)).astype(np.float32) for _ in range(2))
  bd = rng.normal(size=(5, 16)).astype(np.float32)
  glu = functools.partial(clamped_swiglu, alpha=1.702, limit=0.8)
  args = [jnp.asarray(a) for a in (x, weights, indices, wg, wu, wd, bg, bu, bd)]

  backend = CpuBackend() if cpu_kernel else default_backend()

  def run(*args):
    return backend.moe_experts(
        *args[:6], activation=jax.nn.silu, dtype=jnp.float32, method=method, b_gate=args[6], b_up=args[7],
        b_down=args[8], glu=glu,
    )  # fmt: skip

  assert ("ffi_call" in str(jax.make_jaxpr(run)(*args))) == cpu_kernel
  out = jax.jit(run)(*args)
  ref = np.zeros((9, 16))
  gates = []
  for t in range(9):
    for j, e in enumerate(indices[t]):
      xt = x[t].astype(np.float64)
      gate = xt @ wg[e].astype(np.float64) + bg[e]
      gates.append(gate)
      h = _clamped_swiglu64(gate, xt @ wu[e].astype(np.float64) + bu[e])
      ref[t] += weights[t, j] * (h @ wd[e].astype(np.float64) + bd[e])
  assert np.mean(np.concatenate(gates) > 0.8) > 0.1  # the clamp acts
  np.testing.assert_allclose(np.asarray(out), ref, atol=3e-5, rtol=1e-5)


def test_bias_shapes_are_checked():
  x, weights, indices, wg, wu, wd = _case(3, 4, 2)
  with pytest.raises(ValueError, match=r"b_down of shape \(4, 16\) \(w_gate \(4, 16, 12\)\); got \(4, 12\)"):
    experts_tiled(x, weights, indices, wg, wu, wd, activation=jax.nn.silu, dtype=jnp.float32, b_down=np.zeros((4, 12)))


@needs_cpu_kernel
def test_the_cpu_kernel_serves_float32_batches_up_to_its_row_limit_only():
  """`applies_experts`: float32, 1 to MAX_EXPERT_ROWS (token, choice) rows, on the cpu backend only."""
  assert cpu_gemm.load()
  limit = cpu_gemm.MAX_EXPERT_ROWS

  def traced(num_tokens, dtype, on=True):
    x, weights, indices, wg, wu, wd = _case(num_tokens, 4, 2)
    cast = [jnp.asarray(a, dtype) for a in (x, wg, wu, wd)]

    backend = CpuBackend() if on else default_backend()

    def run(x, wg, wu, wd):
      return backend.moe_experts(x, weights, indices, wg, wu, wd, activation=jax.nn.silu, dtype=dtype)

    return "ffi_call" in str(jax.make_jaxpr(run)(*cast))

  assert traced(limit // 2, jnp.float32)
  assert not traced(limit // 2 + 1, jnp.float32)  # 2 choices per token: past the limit
  assert not traced(4, jnp.bfloat16)
  assert not traced(4, jnp.float32, on=False)
