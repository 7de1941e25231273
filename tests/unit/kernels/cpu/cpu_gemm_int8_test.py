"""Weight-only int8 column panels (`quantization=int8w`): the packed format, the kernel against float64 NumPy over the
dequantized weights on every row-count path (x rounded to 16-bit integers per block, as documented, where the library
has the integer dot products; as it is in the build without them), the checks, the `cpu` backend's layout and the
config key."""

import functools
import os
import subprocess
import sys
import textwrap
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.configs import load_config
from maxtext.configs.errors import ConfigError
from maxtext.kernels import backend as kernel_backend
from maxtext.kernels.cpu import backend as cpu_backend
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.layers import embeddings, linears

needs_kernel = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


# Whether this machine's library reads int8 panels with integer dot products (x rounded: `_rounded`).
INT8_DOT = cpu_gemm.int8_dot_reason() is None
needs_int8_dot = pytest.mark.skipif(not INT8_DOT, reason="the integer products need AVX-512 VNNI and VBMI")


def _rounded(x: np.ndarray) -> np.ndarray:
  """x as the integer products read it (`cpu/int8_dot.h`), in NumPy: per row and block of 32, q = round(x / amax *
  32639) in float32 (x times 1 / amax, or x / amax when that overflows), ties to even; x = q * amax / 32639."""
  x = np.asarray(x, np.float32)
  blocks = x.reshape(x.shape[0], -1, 32)
  amax = np.max(np.abs(blocks), axis=2, keepdims=True)
  levels = np.float32(cpu_gemm.INT8_DOT_LEVELS)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    inverse = np.float32(1) / amax
    ratio = np.where(np.isfinite(inverse), blocks * inverse, blocks / amax).astype(np.float32)
    q = np.where(amax > 0, np.rint((ratio * levels).astype(np.float32)), 0)
  return (q * (amax.astype(np.float64) / np.float64(levels))).reshape(x.shape)


def _close(got, x: np.ndarray, w: np.ndarray, int8: bool = False) -> None:
  """Against float64 of x @ w, w the dequantized weights (and x as the integer products read it, for an `int8`
  product on this machine): float32 sums, within 2e-6 of the largest magnitude."""
  if int8 and INT8_DOT:
    x = _rounded(x)
  want = x.astype(np.float64) @ w.astype(np.float64)
  got = np.asarray(got)
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(want)))))


def test_int8_panels_pack_blocks_of_weights_then_scales():
  """Panel t, block b: the 32 x 32 int8 weights row by row, then the 32 float32 scales (max |w| / 127 per column);
  unpacked here byte by byte with NumPy."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 96)).astype(np.float32)
  w[:32, 40] = 0.0  # an all-zero column of a block: scale 1, weights 0
  packed = np.asarray(cpu_gemm.to_int8_panels(w))
  assert packed.shape == (3, 2, cpu_gemm.INT8_BLOCK) == (3, 2, 1152) and packed.dtype == np.uint8
  for t in range(3):
    for b in range(2):
      block = w[32 * b : 32 * b + 32, 32 * t : 32 * t + 32]
      q = packed[t, b, :1024].view(np.int8).reshape(32, 32)
      scale = packed[t, b, 1024:].view(np.float32)
      amax = np.abs(block).max(axis=0)
      np.testing.assert_array_equal(scale, np.where(amax > 0, amax / 127, 1).astype(np.float32))
      assert np.abs(q).max() == 127
      assert np.all(np.abs(q * scale - block) <= scale * 0.50001)
  assert np.all(packed[1, 0, :1024].view(np.int8).reshape(32, 32)[:, 8] == 0)
  deq = cpu_gemm.from_int8_panels(packed)
  assert deq.shape == (64, 96) and deq.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(jax.jit(cpu_gemm.from_int8_panels)(jnp.asarray(packed))), deq)
  abstract = cpu_gemm.to_int8_panels(jax.ShapeDtypeStruct((64, 96), jnp.bfloat16))
  assert abstract == jax.ShapeDtypeStruct((3, 2, 1152), jnp.uint8)


def test_int8_panels_of_a_transposed_view_equal_those_of_a_copy():
  w = np.random.default_rng(2).standard_normal((96, 64)).astype(np.float32).T  # [64, 96], Fortran order
  np.testing.assert_array_equal(
      np.asarray(cpu_gemm.to_int8_panels(w)), np.asarray(cpu_gemm.to_int8_panels(np.ascontiguousarray(w)))
  )


def test_int8_panels_quantize_a_few_panels_at_a_time(monkeypatch):
  """Bit for bit the panels of one pass over the whole matrix; the peak memory stays below the panels plus a few
  chunks, under the 2 MiB a float32 copy of the bfloat16 matrix would take."""
  w = np.random.default_rng(4).standard_normal((512, 1024)).astype(ml_dtypes.bfloat16)
  want = np.asarray(cpu_gemm.to_int8_panels(w))
  monkeypatch.setattr(cpu_gemm, "INT8_CHUNK_VALUES", 512 * 32 * 2)  # two panels
  tracemalloc.start()
  try:
    got = np.asarray(cpu_gemm.to_int8_panels(w))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  np.testing.assert_array_equal(got, want)
  assert peak < want.nbytes + 4 * 512 * 64 * 4 < w.size * 4


def test_int8_panels_of_bf16_weights():
  w = np.random.default_rng(1).standard_normal((32, 32)).astype(ml_dtypes.bfloat16)
  deq = cpu_gemm.from_int8_panels(np.asarray(cpu_gemm.to_int8_panels(w)))
  scale = np.abs(w.astype(np.float32)).max(axis=0) / 127
  assert np.all(np.abs(deq - w.astype(np.float32)) <= scale * 0.50001)


# (M, K, N): one row (Int8PanelRow), 2-8 rows (a dequantized panel in the lanes), past 8 (six rows at a time).
_SHAPES = [
    (1, 32, 32),
    (1, 576, 1536),
    (1, 1536, 576),
    (2, 64, 96),
    (5, 576, 192),
    (8, 96, 4096),
    (9, 64, 64),
    (70, 576, 160),
]


@needs_kernel
@pytest.mark.parametrize("m, k, n", _SHAPES)
def test_int8_panels_match_float64_of_the_dequantized_weights(m, k, n):
  assert cpu_gemm.load()
  rng = np.random.default_rng(m * 1000 + k + n)
  x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
  packed = cpu_gemm.to_int8_panels(w)
  _close(jax.jit(cpu_gemm.matmul)(x, packed), x, cpu_gemm.from_int8_panels(np.asarray(packed)), int8=True)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 12])
def test_matmuls_mix_int8_bf16_and_float32_panels(m):
  """Each result of one call over int8, bfloat16 and float32 panels equals its product alone, bit for bit."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, 64)).astype(np.float32)
  ws = [rng.standard_normal((64, n)).astype(np.float32) for n in (96, 64, 32)]
  operands = [
      cpu_gemm.to_int8_panels(ws[0]),
      cpu_gemm.to_panels(jnp.asarray(ws[1], jnp.bfloat16)),
      cpu_gemm.to_panels(jnp.asarray(ws[2])),
  ]
  dense = [cpu_gemm.from_int8_panels(np.asarray(operands[0])), ws[1].astype(ml_dtypes.bfloat16), ws[2]]
  for i, (operand, w, y) in enumerate(zip(operands, dense, jax.jit(cpu_gemm.matmuls)(x, operands))):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_gemm.matmul)(x, operand)))
    _close(y, x, w, int8=i == 0)


@needs_int8_dot
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9])
def test_integer_products_round_each_block_of_x_to_16_bit_integers(m):
  """Blocks of x at the rounding's edges: all zero, a value at the block's largest magnitude (q = +-32639, the high
  byte's limit), subnormal magnitudes (1 / amax overflows), 1e30; rows of every count path. The rounding stays within
  half a step (amax / 32639 / 2) of each value, so the product is within 1e-4 of the unrounded one."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, 160)).astype(np.float32)
  x[:, 0:32] = 0.0
  x[:, 32] = -np.abs(x[:, 32:64]).max(axis=1) * 2
  x[:, 64:96] *= np.float32(1e-40)
  x[:, 96:128] *= np.float32(1e30)
  w = rng.standard_normal((160, 64)).astype(np.float32)
  w[96:128] *= np.float32(1e-30)
  packed = cpu_gemm.to_int8_panels(w)
  held = cpu_gemm.from_int8_panels(np.asarray(packed))
  got = jax.jit(cpu_gemm.matmul)(x, packed)
  _close(got, x, held, int8=True)
  blocks = x.reshape(m, 5, 32).astype(np.float64)
  step = np.abs(blocks).max(axis=2, keepdims=True) / cpu_gemm.INT8_DOT_LEVELS
  assert np.all(np.abs(_rounded(x).reshape(m, 5, 32) - blocks) <= step * 0.5001)
  plain = x.astype(np.float64) @ held.astype(np.float64)
  np.testing.assert_allclose(np.asarray(got), plain, rtol=0, atol=1e-4 * np.max(np.abs(plain)))


@needs_int8_dot
def test_integer_products_give_nan_for_a_row_with_an_infinity_or_nan():
  """As a float32 product would: the row holding it is NaN (every column), the other rows are untouched."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3, 64)).astype(np.float32)
  x[0, 40], x[2, 3] = np.inf, np.nan
  w = rng.standard_normal((64, 32)).astype(np.float32)
  packed = cpu_gemm.to_int8_panels(w)
  got = np.asarray(jax.jit(cpu_gemm.matmul)(x, packed))
  assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[2]))
  _close(got[1:2], x[1:2], cpu_gemm.from_int8_panels(np.asarray(packed)), int8=True)


@needs_kernel
def test_a_library_built_without_the_integer_products_reads_x_as_it_is(tmp_path):
  """`$MAXTEXT_CPUINFO` naming a CPU without AVX-512 builds the library without them (its own file in the cache):
  int8 panels are then widened to float32 and x is not rounded, at every row-count path."""
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n", encoding="utf-8")
  script = textwrap.dedent("""
      import jax, numpy as np
      from maxtext.kernels.cpu import cpu_gemm
      assert cpu_gemm.int8_dot_reason() is not None and cpu_gemm.load()
      assert not any("avx512" in flag for flag in cpu_gemm.compile_flags())
      rng = np.random.default_rng(0)
      w = rng.standard_normal((96, 64)).astype(np.float32)
      packed = cpu_gemm.to_int8_panels(w)
      held = cpu_gemm.from_int8_panels(np.asarray(packed)).astype(np.float64)
      for m in (1, 3, 12):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        want = x.astype(np.float64) @ held
        got = np.asarray(jax.jit(cpu_gemm.matmul)(x, packed))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.max(np.abs(want)))
      print("ok", sorted(p.name for p in cpu_gemm.cache_dir().glob("*.so")))
      """)
  env = dict(os.environ, MAXTEXT_CPUINFO=str(cpuinfo), MAXTEXT_CACHE_DIR=str(tmp_path / "cache"))
  result = subprocess.run(
      [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("ok ['maxtext_cpu-")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_a_tied_head_reads_an_int8_copy_of_its_table(rows):
  """With int8w the tied head reads int8 panels of `table^T` (the lookups keep the table), matching float64 of the
  dequantized copy; restore_params drops the copy and the head reads the table again."""
  embed = embeddings.Embed(96, 64, weight_dtype=jnp.bfloat16, rngs=nnx.Rngs(rows))
  table = np.asarray(embed.embedding[...]).astype(np.float32)
  backend = CpuBackend()
  backend.configure(load_config(model_name="qwen3-tiny", weight_dtype="bfloat16", quantization="int8w"))
  assert backend.prepare_params(embed) == 96 // 32 * 64 // 32 * cpu_gemm.INT8_BLOCK
  assert embed.head_layout == cpu_backend.PANELS_INT8 and embed.head[...].shape == (3, 2, cpu_gemm.INT8_BLOCK)
  held = cpu_gemm.from_int8_panels(np.asarray(embed.head[...]))  # [D, V]
  np.testing.assert_allclose(held, table.T, rtol=0, atol=np.max(np.abs(table)) / 127)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
  _close(jax.jit(functools.partial(embed.attend, backend=backend))(x), np.asarray(x), held, int8=True)
  tokens = jnp.asarray([3, 95])
  np.testing.assert_array_equal(np.asarray(embed(tokens)), table[[3, 95]])  # lookups read the table
  backend.restore_params(embed)
  assert embed.head is None and embed.head_layout is None
  _close(embed.attend(x, backend), np.asarray(x), table.T)


def test_the_int8_head_copy_serves_multiples_of_32_in_float32_compute_only():
  assert cpu_backend.to_int8_head(jax.ShapeDtypeStruct((64, 49152), jnp.bfloat16), jnp.float32) == (
      jax.ShapeDtypeStruct((49152 // 32, 2, cpu_gemm.INT8_BLOCK), jnp.uint8)
  )
  assert cpu_backend.to_int8_head(jax.ShapeDtypeStruct((64, 100), jnp.bfloat16), jnp.float32) is None
  assert cpu_backend.to_int8_head(jax.ShapeDtypeStruct((40, 64), jnp.bfloat16), jnp.float32) is None
  assert cpu_backend.to_int8_head(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), jnp.bfloat16) is None
  embed = embeddings.Embed(100, 64, rngs=nnx.Rngs(0))
  assert embed.add_head_copy(cpu_backend.PANELS_INT8, cpu_backend.to_int8_head) == 0 and embed.head is None


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (cpu_gemm.to_int8_panels, (np.zeros((48, 32)),), r"K and N multiples of 32, got shape \(48, 32\)"),
        (cpu_gemm.to_int8_panels, (np.zeros((32, 40)),), r"K and N multiples of 32, got shape \(32, 40\)"),
        (cpu_gemm.from_int8_panels, (np.zeros((1, 1, 1024), np.uint8),), r"uint8 \[N / 32, K / 32, 1152\], got uint8"),
        (cpu_gemm.matmul, (jnp.zeros((2, 64)), jnp.zeros((1, 1, 1152), jnp.uint8)), r"x \(2, 64\) does not match"),
        (cpu_gemm.matmul, (jnp.zeros((2, 32)), jnp.zeros((1, 1, 1024), jnp.uint8)), r"got \(1, 1, 1024\)"),
        (
            cpu_gemm.matmul,
            (jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((1, 1, 1152), jnp.uint8)),
            r"takes a float32 x, got x bfloat16",
        ),
        (cpu_gemm.matmul_transposed, (jnp.zeros((2, 4)), jnp.zeros((5, 4), jnp.uint8)), r"got x float32 and w uint8"),
    ],
)
def test_int8_operands_are_checked(fn, args, match):
  with pytest.raises(ValueError, match=match):
    fn(*args)


@needs_kernel
def test_kernel_checks_int8_panels():
  """The library's own check, reached by calling its target directly (`matmul` checks first)."""
  assert cpu_gemm.load()
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS["nn"][0], jax.ShapeDtypeStruct((2, 32), jnp.float32))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"int8 column panels \[N / 32, K / 32, 1152\]"):
    jax.block_until_ready(jax.jit(call)(np.ones((2, 32), np.float32), np.ones((1, 1, 1024), np.uint8)))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"the shapes of x, int8 column panels w and y do not match"):
    jax.block_until_ready(jax.jit(call)(np.ones((2, 64), np.float32), np.ones((1, 1, 1152), np.uint8)))


def test_backend_int8_panels_serve_k_and_n_multiples_of_32_only():
  assert cpu_backend.to_int8_panels(np.ones((64, 32), np.float32), jnp.float32).shape == (1, 2, 1152)
  assert cpu_backend.to_int8_panels(np.ones((40, 32), np.float32), jnp.float32) is None
  assert cpu_backend.to_int8_panels(np.ones((64, 48), np.float32), jnp.float32) is None
  assert cpu_backend.to_int8_panels(np.ones((64, 32), np.float32), jnp.bfloat16) is None


def _converts(fn, *args) -> list[str]:
  jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)  # pylint: disable=unnecessary-lambda
  return [str(e.params["new_dtype"]) for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 20])
def test_prepare_params_quantizes_what_int8_panels_serve(rows):
  """K = 64 goes into int8 panels, K = 40 into bfloat16 panels; both in one kernel call, without conversions,
  matching float64 of the weights each layout holds; restore_params gives the dequantized [in, out] back."""
  rngs = nnx.Rngs(rows)
  layers = nnx.List(
      [
          linears.DenseGeneral(64, (2, 32), dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=rngs),
          linears.DenseGeneral(64, 96, dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=rngs),
          linears.DenseGeneral(40, 64, dtype=jnp.float32, weight_dtype=jnp.bfloat16, rngs=rngs),
      ]
  )
  backend = CpuBackend()
  backend.configure(load_config(model_name="llama-tiny", weight_dtype="bfloat16", quantization="int8w"))
  canonical = [np.asarray(layer.kernel[...]).reshape(layer.kernel.shape[0], -1) for layer in layers]
  assert backend.prepare_params(layers) == 64 * 64 // 32 * 36 + 64 * 96 // 32 * 36 + 40 * 64 * 2
  assert [layer.layout for layer in layers] == [cpu_backend.PANELS_INT8] * 2 + [cpu_backend.PANELS]
  assert backend.prepare_params(layers) == 64 * 64 // 32 * 36 + 64 * 96 // 32 * 36 + 40 * 64 * 2  # idempotent
  held = [cpu_gemm.from_int8_panels(np.asarray(layer.kernel[...])) for layer in layers[:2]] + [canonical[2]]
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
  run = functools.partial(linears.project, layers=list(layers[:2]), backend=backend)
  assert _converts(run, x) == [] and str(jax.make_jaxpr(run)(x)).count("ffi_call") == 1
  for y, w in zip(jax.jit(run)(x), held):
    _close(np.asarray(y).reshape(rows, -1), np.asarray(x), w, int8=True)
  x40 = x[:, :40]
  _close(jax.jit(functools.partial(layers[2], backend=backend))(x40), np.asarray(x40), held[2])
  backend.restore_params(layers)
  assert all(layer.layout is None for layer in layers)
  np.testing.assert_array_equal(np.asarray(layers[1].kernel[...]), held[1])
  assert layers[0].kernel.shape == (64, 2, 32)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"quantization": "int4"}, r"quantization='int4': must be '' \(weights in weight_dtype\) or 'int8w'"),
        ({"quantization": "int8w"}, r"quantization='int8w' keeps .* must then be bfloat16; got weight_dtype='float32'"),
    ],
)
def test_quantization_key_is_validated(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config(model_name="llama-tiny", **overrides)
  assert load_config(model_name="llama-tiny", weight_dtype="bfloat16", quantization="int8w").quantization == "int8w"


def test_only_the_cpu_backend_takes_quantization():
  cfg = load_config(model_name="llama-tiny", weight_dtype="bfloat16", quantization="int8w")
  with pytest.raises(ConfigError, match=r"quantization='int8w' needs kernel_backend=cpu .* kernel_backend=reference"):
    kernel_backend.get_backend("reference", None, cfg)
