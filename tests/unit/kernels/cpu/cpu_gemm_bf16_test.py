"""The small-batch CPU kernel with bfloat16 weights (float32 x and sums): numerics against float64 NumPy on every
row-count path, dtype checks, and the `cpu` backend keeping a weight-only bfloat16 model's weights compact."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.kernels.cpu import backend as cpu_backend
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.layers import embeddings, linears

needs_kernel = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def _close(got, x: np.ndarray, w: np.ndarray) -> None:
  """Against float64 of x @ w (w's bfloat16 values exactly): the kernel sums float32 products, so within 2e-6 of
  the largest magnitude, as for float32 weights."""
  want = x.astype(np.float64) @ w.astype(np.float64)
  got = np.asarray(got)
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(want)))))


# (M, K, N): one row (PanelRow; RowAccumulate, with rows of w past 2048 columns too), 2-8 rows (NNAccumulate, its
# 8-row blocks and K tails; NT 2-6 one row of w at a time, 7-8 eight rows side by side), and past 8 rows
# (PanelManyRows: six at a time and the 1-5 left over).
_SHAPES = [
    (1, 64, 32),
    (1, 301, 2080),
    (1, 576, 1536),
    (2, 33, 96),
    (3, 576, 192),
    (6, 17, 64),
    (7, 1536, 576),
    (8, 45, 4096),
    (9, 64, 96),
    (13, 130, 64),
    (70, 576, 160),
]


@needs_kernel
@pytest.mark.parametrize("m, k, n", _SHAPES)
def test_bf16_weights_match_float64(m, k, n):
  """Row-major and transposed at 1-8 rows; in column panels at any number of rows."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m * 1000 + k + n)
  x, w = rng.standard_normal((m, k)).astype(np.float32), _bf16(rng, (k, n))
  panels = cpu_gemm.to_panels(jnp.asarray(w))
  assert panels.dtype == jnp.bfloat16
  _close(jax.jit(cpu_gemm.matmul)(x, panels), x, w)
  if m <= cpu_gemm.MAX_ROWS:
    _close(jax.jit(cpu_gemm.matmul)(x, w), x, w)
    _close(jax.jit(cpu_gemm.matmul_transposed)(x, np.ascontiguousarray(w.T)), x, w)


@needs_kernel
@pytest.mark.parametrize("m", [1, 4, 11])
def test_matmuls_mix_float32_and_bf16_weights(m):
  """One call over float32 and bfloat16 weights, panels and (up to 8 rows) row-major: each result equals its
  product alone, bit for bit."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, 96)).astype(np.float32)
  ws = [_bf16(rng, (96, 64)), rng.standard_normal((96, 128)).astype(np.float32), _bf16(rng, (96, 40))]
  operands = [cpu_gemm.to_panels(jnp.asarray(ws[0])), cpu_gemm.to_panels(jnp.asarray(ws[1]))]
  if m <= cpu_gemm.MAX_ROWS:
    operands.append(jnp.asarray(ws[2]))
  together = jax.jit(cpu_gemm.matmuls)(x, operands)
  for operand, w, y in zip(operands, ws, together):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_gemm.matmul)(x, operand)))
    _close(y, x, w)


@pytest.mark.parametrize(
    "fn, x, w, match",
    [
        (cpu_gemm.matmul, jnp.zeros((2, 4)), jnp.zeros((4, 32), jnp.float16), r"float32 or bfloat16 w, got x float32"),
        (cpu_gemm.matmul, jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((4, 32), jnp.bfloat16), r"got x bfloat16 and w"),
        (cpu_gemm.matmul_transposed, jnp.zeros((2, 4)), jnp.zeros((5, 4), jnp.int8), r"got x float32 and w int8"),
        (cpu_gemm.matmul, jnp.zeros((2, 5)), jnp.zeros((1, 4, 32), jnp.bfloat16), r"do not share their inner size"),
    ],
)
def test_products_reject_other_weight_dtypes(fn, x, w, match):
  with pytest.raises(ValueError, match=match):
    fn(x, w)


@needs_kernel
@pytest.mark.parametrize("target", ["nn", "nt"])
def test_kernel_checks_the_weight_dtype(target):
  """The library's own check, reached by calling its target directly (`matmul` checks first)."""
  assert cpu_gemm.load()
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS[target][0], jax.ShapeDtypeStruct((2, 4), jnp.float32))
  match = rf"small_gemm_{target}: w must be float32, bfloat16 or \(NN\) uint8 int8 column panels, got XLA element type"
  with pytest.raises(jax.errors.JaxRuntimeError, match=match):
    jax.block_until_ready(jax.jit(call)(np.ones((2, 4), np.float32), np.ones((4, 4), np.float16)))
  many = jax.ffi.ffi_call(cpu_gemm.TARGETS["nn_many"][0], (jax.ShapeDtypeStruct((2, 4), jnp.float32),) * 2)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"small_gemm_nn_many: w must be float32, bfloat16 or"):
    jax.block_until_ready(
        jax.jit(many)(np.ones((2, 4), np.float32), np.ones((4, 4), np.float32), np.ones((4, 4), np.int8))
    )


@needs_kernel
def test_applies_takes_bf16_weights_with_float32_x_only():
  assert cpu_gemm.applies(4, jnp.float32, jnp.bfloat16, jnp.float32)
  assert cpu_gemm.applies_panels(300, jnp.float32, jnp.bfloat16)
  assert not cpu_gemm.applies(4, jnp.bfloat16, jnp.bfloat16)
  assert not cpu_gemm.applies(4, jnp.float32, jnp.float16)
  assert not cpu_gemm.applies_experts(4, jnp.float32, jnp.bfloat16)  # the expert products read float32 only


def test_backend_panels_keep_bf16_weights_of_float32_layers():
  flat = np.ones((8, 64), ml_dtypes.bfloat16)
  panels = cpu_backend.to_panels(flat, jnp.float32)
  assert panels.shape == (2, 8, 32) and panels.dtype == jnp.bfloat16
  assert cpu_backend.to_panels(jax.ShapeDtypeStruct((8, 64), jnp.bfloat16), jnp.float32).dtype == jnp.bfloat16
  assert cpu_backend.to_panels(flat, jnp.bfloat16) is None  # bfloat16 compute stays with XLA
  assert cpu_backend.to_panels(np.ones((8, 64), np.float16), jnp.float32) is None


def _converts(fn, *args) -> list[str]:
  """The dtype conversions a fresh trace of `fn` makes, as `from->to` strings."""
  jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)  # pylint: disable=unnecessary-lambda
  return [
      f"{eqn.invars[0].aval.dtype}->{eqn.params['new_dtype']}"
      for eqn in jaxpr.eqns
      if eqn.primitive.name == "convert_element_type"
  ]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 24])
def test_project_sends_bf16_panels_to_the_kernel_as_stored(rows):
  """A weight-only bfloat16 layer in panels: one kernel call that reads the bfloat16 panels (no conversion of the
  weights in the program), results within float32 rounding of float64 at any number of rows."""
  rngs = nnx.Rngs(rows)
  layers = [
      linears.DenseGeneral(64, (2, 16), dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=rngs),
      linears.DenseGeneral(64, 96, dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=rngs),
  ]
  backend = CpuBackend()
  kernels = [np.asarray(layer.kernel[...]).reshape(64, -1) for layer in layers]
  assert backend.prepare_params(nnx.Dict(layers=nnx.List(layers))) == sum(w.size * 2 for w in kernels)
  assert all(layer.layout == cpu_backend.PANELS and layer.kernel[...].dtype == jnp.bfloat16 for layer in layers)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
  run = functools.partial(linears.project, layers=layers, backend=backend)
  assert _converts(run, x) == []
  assert str(jax.make_jaxpr(run)(x)).count("ffi_call") == 1
  for y, w in zip(jax.jit(run)(x), kernels):
    _close(np.asarray(y).reshape(rows, -1), np.asarray(x), w)


@needs_kernel
def test_project_casts_bf16_weights_only_for_xla():
  """Past 8 rows a row-major bfloat16 kernel (N not a multiple of 32: no panels) is an XLA dot in float32."""
  layer = linears.DenseGeneral(64, 40, dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  backend = CpuBackend()
  assert backend.prepare_params(layer) == 0
  w = np.asarray(layer.kernel[...])
  for rows, kernel_calls, converts in ((8, 1, []), (9, 0, ["bfloat16->float32"])):
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
    run = functools.partial(layer, backend=backend)
    assert str(jax.make_jaxpr(run)(x)).count("ffi_call") == kernel_calls
    assert _converts(run, x) == converts
    _close(jax.jit(run)(x), np.asarray(x), w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 7, 8])
def test_tied_head_reads_a_bf16_table_as_stored(rows):
  rng = np.random.default_rng(rows)
  table = _bf16(rng, (200, 64))
  x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
  backend = CpuBackend()

  def head(t, h):
    return embeddings.attend(t, h, dtype=jnp.float32, backend=backend)

  assert _converts(head, table, x) == []
  _close(jax.jit(head)(table, x), np.asarray(x), table.T)
  tokens = jnp.asarray([3, 199, 0])
  looked_up = embeddings.embed_tokens(jnp.asarray(table), tokens, scale=None, dtype=jnp.float32)
  assert looked_up.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(looked_up), table[[3, 199, 0]].astype(np.float32))
