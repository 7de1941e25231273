"""Tests for the small-batch CPU matmul kernel: build, registration, numerics against float64 NumPy, dispatch."""

import fnmatch
import functools
import logging
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.layers import embeddings, linears

needs_kernel = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  return x.astype(np.float64) @ w.astype(np.float64)


def _close(got, want) -> None:
  """fp32 sums of up to a few thousand products: within 2e-6 of the largest magnitude."""
  got = np.asarray(got)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(want)))))


def test_cpu_flags_reads_the_flags_line():
  text = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\nbugs\t: none\n"
  assert cpu_gemm.cpu_flags(text) == {"fpu", "sse", "avx2", "fma"}
  assert cpu_gemm.cpu_flags("processor: 0\n") == set()


def test_cpu_flags_read_the_file_maxtext_cpuinfo_names(monkeypatch, tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("flags\t\t: avx2 fma avx512f\n", encoding="utf-8")
  monkeypatch.setenv("MAXTEXT_CPUINFO", str(cpuinfo))
  assert cpu_gemm.cpu_flags() == {"avx2", "fma", "avx512f"}
  monkeypatch.setenv("MAXTEXT_CPUINFO", str(tmp_path / "missing"))
  assert cpu_gemm.cpu_flags() == set()


def test_the_library_takes_the_integer_products_where_the_cpu_has_all_four_flags():
  avx2 = {"avx2", "fma"}
  full = avx2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"}
  assert cpu_gemm.int8_dot_reason(full) is None
  assert cpu_gemm.compile_flags(full)[-4:] == ("-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512vbmi")
  assert cpu_gemm.int8_dot_reason(full - {"avx512vbmi"}) == "the CPU lacks avx512vbmi"
  assert cpu_gemm.int8_dot_reason(avx2) == "the CPU lacks avx512_vnni, avx512bw, avx512f, avx512vbmi"
  assert cpu_gemm.compile_flags(full - {"avx512_vnni"}) == cpu_gemm.compile_flags(avx2)
  assert not any("avx512" in flag for flag in cpu_gemm.compile_flags(avx2))


@pytest.mark.parametrize(
    "machine, flags, reason",
    [
        ("x86_64", {"avx2", "fma", "sse"}, None),
        ("AMD64", {"avx2", "fma"}, None),
        ("aarch64", {"avx2", "fma"}, "the CPU is aarch64, not x86-64"),
        ("x86_64", {"avx2"}, "the CPU lacks fma"),
        ("x86_64", set(), "the CPU lacks avx2, fma"),
    ],
)
def test_unsupported_reason(machine, flags, reason):
  assert cpu_gemm.unsupported_reason(machine, flags) == reason


@pytest.mark.slow
@needs_kernel
def test_build_reuses_the_library_and_rebuilds_for_another_compiler(tmp_path):
  path = cpu_gemm.build(folder=tmp_path)
  assert path.parent == tmp_path and path.suffix == ".so"
  stamp = path.stat().st_mtime_ns
  assert cpu_gemm.build(folder=tmp_path) == path
  assert path.stat().st_mtime_ns == stamp  # not compiled again
  assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left behind
  other = cpu_gemm.build(compiler="g++", folder=tmp_path)
  assert other != path and other.exists()


def test_build_names_a_missing_or_failing_compiler(tmp_path):
  with pytest.raises(RuntimeError, match=r"cannot run the C\+\+ compiler '/nonexistent/c\+\+'"):
    cpu_gemm.build(compiler="/nonexistent/c++", folder=tmp_path)
  with pytest.raises(
      RuntimeError, match=r"false failed \(exit status 1\) building small_gemm.cc, expert_gemm.cc, paged_attention.cc"
  ):
    cpu_gemm.build(compiler="false", folder=tmp_path)


def test_every_kernel_source_is_built_and_shipped():
  """Each C++ file of `kernels/cpu/` is compiled (or included) into the library and listed in the package data."""
  files = {p.name for p in cpu_gemm.SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h")}
  assert files == {p.name for p in cpu_gemm.SOURCES + cpu_gemm.HEADERS}
  pyproject = tomllib.loads((Path(__file__).parents[4] / "pyproject.toml").read_text(encoding="utf-8"))
  patterns = pyproject["tool"]["setuptools"]["package-data"]["maxtext"]
  for name in files:
    assert any(fnmatch.fnmatch(f"kernels/cpu/{name}", pattern) for pattern in patterns), name


def test_build_without_any_compiler(tmp_path, monkeypatch):
  monkeypatch.delenv("CXX", raising=False)
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found \(set CXX, or install g\+\+\)"):
    cpu_gemm.build(folder=tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  assert cpu_gemm.cache_dir() == tmp_path / "kernels"
  monkeypatch.delenv("MAXTEXT_CACHE_DIR")
  assert cpu_gemm.cache_dir() == cpu_gemm.Path.home() / ".cache" / "maxtext" / "kernels"


def test_load_reports_why_the_kernel_is_not_used(monkeypatch, caplog):
  monkeypatch.setattr(cpu_gemm, "unsupported_reason", lambda: "the CPU is riscv64, not x86-64")
  cpu_gemm.load.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
      assert cpu_gemm.load() is False
    assert "not used (XLA's dot is): the CPU is riscv64, not x86-64" in caplog.text
    assert not cpu_gemm.applies(4, jnp.float32, jnp.float32)
  finally:
    cpu_gemm.load.cache_clear()


@needs_kernel
def test_load_reports_a_failed_build(monkeypatch, caplog, tmp_path):
  monkeypatch.setenv("CXX", "false")
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  cpu_gemm.load.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
      assert cpu_gemm.load() is False
    assert "false failed (exit status 1)" in caplog.text
  finally:
    cpu_gemm.load.cache_clear()


# (M, K, N): every row count, K and N below, at and past the kernels' blocks of 8 columns, 8 k-steps, 256-column
# chunks (NN) and 512-row chunks (NT), and the decode benchmark's shapes.
_SHAPES = [
    (1, 1, 1),
    (2, 7, 3),
    (3, 8, 8),
    (4, 9, 13),
    (5, 17, 257),
    (6, 64, 1000),
    (7, 515, 300),
    (8, 512, 3072),
    (8, 1536, 512),
    (8, 512, 32000),
    (2, 512, 4100),
    (1, 512, 32000),  # one row: a stream per row slice (NN), a dot product per row of w (NT)
    (1, 45, 1030),  # ... with K tails (past 8 and 32 floats) and a partial last task
    (1, 1536, 517),  # ... 8 row slices of w, N past a multiple of 16
    (1, 301, 2055),  # ... rows of w read eight at a time (NN), with K and N tails
]


# (M, K, N): one row, 2-8 rows (lanes) and more (six at a time, with 1-5 left over); K with tails past 8 and 32; one
# panel, two, many, and the widest in panels.
_PANEL_SHAPES = [
    (1, 512, 512),
    (1, 45, 32),
    (1, 7, 8192),
    (2, 301, 64),
    (3, 512, 1536),
    (7, 1536, 512),
    (8, 33, 96),
    (9, 64, 96),
    (12, 17, 32),
    (70, 512, 1536),
    (131, 45, 64),
]


@needs_kernel
@pytest.mark.parametrize("m, k, n", _SHAPES + _PANEL_SHAPES)
def test_matmul_matches_float64(m, k, n):
  """Row-major and transposed at 1-8 rows; in column panels wherever N is a multiple of 32."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  if m <= cpu_gemm.MAX_ROWS:
    _close(jax.jit(cpu_gemm.matmul)(x, w), _reference(x, w))
    _close(jax.jit(cpu_gemm.matmul_transposed)(x, np.ascontiguousarray(w.T)), _reference(x, w))
  if n % cpu_gemm.PANEL == 0:
    _close(jax.jit(cpu_gemm.matmul)(x, cpu_gemm.to_panels(jnp.asarray(w))), _reference(x, w))


@needs_kernel
def test_matmul_leaves_no_stale_values_between_calls():
  """Two calls of different shapes in one program: each output holds only its own product."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 40)).astype(np.float32)
  w1, w2 = rng.standard_normal((40, 24)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32)

  def both(x, w1, w2):
    return cpu_gemm.matmul(x, w1), cpu_gemm.matmul(x[:3], w2), cpu_gemm.matmul_transposed(x[:5], w1.T)

  a, b, c = jax.jit(both)(x, w1, w2)
  _close(a, _reference(x, w1))
  _close(b, _reference(x[:3], w2))
  _close(c, _reference(x[:5], w1))


@pytest.mark.parametrize(
    "x, w, match",
    [
        (jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), r"2-D operands, got x \(2, 3, 4\) and w \(4, 5\)"),
        (jnp.zeros((9, 4)), jnp.zeros((4, 5)), r"1 to 8 rows \(any number with panels\), got x \(9, 4\)"),
        (jnp.zeros((2, 4)), jnp.zeros((3, 5)), r"x \(2, 4\) and w \(3, 5\) \(nn\) do not share their inner size"),
        (
            jnp.zeros((2, 4), jnp.bfloat16),
            jnp.zeros((4, 5)),
            r"a float32 x and a float32 or bfloat16 w, got x bfloat16 and w float32",
        ),
    ],
)
def test_matmul_rejects_what_the_kernel_cannot_take(x, w, match):
  with pytest.raises(ValueError, match=match):
    cpu_gemm.matmul(x, w)


def test_matmul_transposed_checks_the_inner_size_of_the_table():
  with pytest.raises(ValueError, match=r"x \(2, 4\) and w \(5, 3\) \(nt\) do not share their inner size"):
    cpu_gemm.matmul_transposed(jnp.zeros((2, 4)), jnp.zeros((5, 3)))


@needs_kernel
def test_applies_for_one_to_eight_float32_rows():
  assert [cpu_gemm.applies(r, jnp.float32, jnp.float32) for r in (0, 1, 8, 9)] == [False, True, True, False]
  assert not cpu_gemm.applies(4, jnp.bfloat16, jnp.float32)


def _uses_kernel(fn, *args) -> bool:
  """Whether a fresh trace of `fn` calls the kernel (a wrapper per call: JAX caches traces per function)."""
  return "ffi_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))  # pylint: disable=unnecessary-lambda


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_dense_general_takes_the_kernel_for_small_batches_only(rows):
  """Multi-axis inputs and outputs (an output projection [H, d] -> [D] and a query projection [D] -> [H, d])."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 4, 16)), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((4, 16, 24)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((24, 4, 16)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

  def project(x, w_out, w_in, bias, backend=None):
    y = linears.dense_general(x, w_out, None, num_in_axes=2, dtype=jnp.float32, backend=backend)
    return y, linears.dense_general(y, w_in, bias, num_in_axes=1, dtype=jnp.float32, backend=backend)

  on_cpu = functools.partial(project, backend=CpuBackend())
  assert _uses_kernel(on_cpu, x, w_out, w_in, bias) == (1 <= rows <= 8)
  y, z = jax.jit(on_cpu)(x, w_out, w_in, bias)
  assert not _uses_kernel(project, x, w_out, w_in, bias)  # the reference backend
  want_y = _reference(np.asarray(x).reshape(rows, 64), np.asarray(w_out).reshape(64, 24))
  want_z = _reference(np.asarray(y), np.asarray(w_in).reshape(24, 64)) + np.asarray(bias).reshape(64)
  assert y.shape == (rows, 24) and z.shape == (rows, 4, 16)
  _close(y, want_y)
  _close(np.asarray(z).reshape(rows, 64), want_z)


# (M, K, widths): the products of one call take every path of the NN kernel side by side: one row (short rows of w,
# rows read eight at a time, a width below 8), 2-8 rows narrow (slices of rows of w) and wide (chunks of columns).
_MANY_CASES = [
    (1, 512, [512, 256, 256]),
    (1, 301, [2055, 16, 16, 3]),
    (3, 45, [300, 2100, 1]),
    (8, 512, [1536, 1536]),
    (5, 130, [4100, 17]),
]


@needs_kernel
@pytest.mark.parametrize("m, k, widths", _MANY_CASES)
def test_matmuls_equal_each_matmul_bit_for_bit(m, k, widths):
  assert cpu_gemm.load()
  rng = np.random.default_rng(m * 1000 + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  ws = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
  together = jax.jit(cpu_gemm.matmuls)(x, ws)
  assert len(together) == len(ws)
  for w, y in zip(ws, together):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_gemm.matmul)(x, w)))
    _close(y, _reference(x, w))


@pytest.mark.parametrize(
    "ws, match",
    [
        ([], r"one or more w, got none"),
        ([jnp.zeros((4, 5)), jnp.zeros((3, 5))], r"ws\[1\]: .*x \(2, 4\) and w \(3, 5\) \(nn\) do not share"),
        ([jnp.zeros((4, 5), jnp.float16)], r"ws\[0\]: small-batch matmul takes a float32 x and a float32 or bfloat16 w"),
    ],
)
def test_matmuls_rejects_what_the_kernel_cannot_take(ws, match):
  with pytest.raises(ValueError, match=match):
    cpu_gemm.matmuls(jnp.zeros((2, 4)), ws)


@needs_kernel
@pytest.mark.parametrize(
    "results, match",
    [
        ([(2, 5)], r"takes x, one or more w and as many results"),
        ([(2, 5), (2, 7)], r"the shapes of x, w and y do not match"),
    ],
)
def test_matmuls_kernel_checks_its_operands(results, match):
  """The library's own checks, reached by calling its target directly (`matmuls` checks first)."""
  assert cpu_gemm.load()
  out = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in results]
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS["nn_many"][0], out)
  x, w = np.ones((2, 4), np.float32), np.ones((4, 5), np.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=match):
    jax.block_until_ready(jax.jit(call)(x, w, w))


def _count_kernel_calls(fn, *args) -> int:
  return str(jax.make_jaxpr(lambda *a: fn(*a))(*args)).count("ffi_call")  # pylint: disable=unnecessary-lambda


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_project_takes_one_kernel_call_for_small_batches(rows):
  """Queries, keys and values with biases and multi-axis outputs: one call up to 8 rows, equal bit for bit to the
  layers called one by one; past 8 rows, XLA's dot per layer."""
  rngs = nnx.Rngs(rows)
  layers = [
      linears.DenseGeneral(32, (4, 8), use_bias=True, rngs=rngs),
      linears.DenseGeneral(32, (2, 8), use_bias=True, rngs=rngs),
      linears.DenseGeneral(32, 5, rngs=rngs),
  ]
  for layer in layers[:2]:
    layer.bias[...] = jnp.asarray(np.random.default_rng(rows).standard_normal(layer.out_shape), jnp.float32)
  x = jnp.asarray(np.random.default_rng(rows + 1).standard_normal((rows, 32)), jnp.float32)
  backend = CpuBackend()
  assert _count_kernel_calls(lambda x: linears.project(x, layers, backend), x) == (1 if rows <= 8 else 0)
  together = linears.project(x, layers, backend)
  one_by_one = [layer(x, backend) for layer in layers]
  for layer, got, want in zip(layers, together, one_by_one):
    assert got.shape == (rows,) + layer.out_shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bias = 0.0 if layer.bias is None else np.asarray(layer.bias[...]).reshape(-1)
    _close(
        np.asarray(got).reshape(rows, -1), _reference(np.asarray(x), np.asarray(layer.kernel[...]).reshape(32, -1)) + bias
    )


@needs_kernel
def test_project_calls_layers_of_other_inputs_one_by_one():
  rngs = nnx.Rngs(0)
  layers = [linears.DenseGeneral(32, 8, rngs=rngs), linears.DenseGeneral((4, 8), 8, rngs=rngs)]
  x = jnp.ones((2, 4, 8), jnp.float32)
  backend = CpuBackend()
  assert _count_kernel_calls(lambda x: linears.project(x, layers[1:], backend), x) == 1
  with pytest.raises(ValueError, match=r"trailing input axes \(32,\), got input shape \(2, 4, 8\)"):
    linears.project(x, layers, backend)
  with pytest.raises(ValueError, match=r"trailing input axes \(4, 8\), got input shape \(2, 32\)"):
    linears.project(jnp.ones((2, 32)), layers[1:] * 2, backend)
  with pytest.raises(ValueError, match=r"one or more layers, got none"):
    linears.project(x, [])


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 32), (2, 2, 32), (1, 32), (1, 1, 37)])
def test_tied_head_takes_the_transposed_kernel(shape):
  rng = np.random.default_rng(7)
  table = jnp.asarray(rng.standard_normal((100, 32)), jnp.float32)
  table = table[:, : shape[-1]] if shape[-1] <= 32 else jnp.asarray(rng.standard_normal((100, shape[-1])), jnp.float32)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  backend = CpuBackend()
  assert _uses_kernel(lambda t, h: embeddings.attend(t, h, dtype=jnp.float32, backend=backend), table, x)
  assert not _uses_kernel(lambda t, h: embeddings.attend(t, h, dtype=jnp.float32), table, x)
  logits = embeddings.attend(table, x, dtype=jnp.float32, backend=backend)
  assert logits.shape == shape[:-1] + (100,)
  want = _reference(np.asarray(x).reshape(-1, shape[-1]), np.asarray(table).T).reshape(shape[:-1] + (100,))
  _close(logits, want)


def test_small_batch_programs_compile_without_ynnpack_fusions():
  """The options are accepted by this jaxlib and remove YNNPACK's fusions from a decode-sized program."""
  options = cpu_gemm.small_batch_compiler_options()
  assert options == {"xla_cpu_experimental_ynn_fusion_type": ""}

  def scores(q, k):
    return jnp.exp(jnp.sum(q[:, None] * k, axis=-1))

  q, k = jnp.ones((8, 64)), jnp.ones((8, 128, 64))
  default = jax.jit(scores).lower(q, k).compile().as_text()
  small = jax.jit(scores, compiler_options=options).lower(q, k).compile().as_text()
  assert "ynn_fusion" in default and "ynn_fusion" not in small
  np.testing.assert_allclose(jax.jit(scores, compiler_options=options)(q, k), jax.jit(scores)(q, k), rtol=1e-6)


def test_small_batch_options_unknown_to_jaxlib_fall_back_to_defaults(monkeypatch, caplog):
  monkeypatch.setattr(cpu_gemm, "_SMALL_BATCH_OPTIONS", {"xla_cpu_no_such_option_for_this_test": ""})
  cpu_gemm.small_batch_compiler_options.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=cpu_gemm.__name__):
      assert not cpu_gemm.small_batch_compiler_options()
    assert "keep XLA's default fusions" in caplog.text and "xla_cpu_no_such_option_for_this_test" in caplog.text
  finally:
    cpu_gemm.small_batch_compiler_options.cache_clear()


def _expert_reference(x: np.ndarray, w: np.ndarray, experts: np.ndarray) -> np.ndarray:
  return np.einsum("rk,rkn->rn", x.astype(np.float64), w[experts].astype(np.float64))


# (rows, E, K, N, experts): a single row (one task, sliced rows of w), rows of distinct experts, an expert with more
# than 8 rows (chunks of 8 and a remainder), K not a multiple of 4 or 8, N past the lanes' 2048-column buffer
# (column blocks), the decode benchmark's batch-8 routing size, and one row as wide as the buffer.
_EXPERT_CASES = [
    (1, 4, 512, 256, [2]),
    (2, 16, 512, 256, [3, 11]),
    (11, 3, 37, 19, [1] * 9 + [0, 2]),
    (5, 4, 130, 2100, [3, 0, 3, 1, 3]),
    (16, 16, 512, 256, None),
    (1, 2, 77, 2048, [1]),  # a row of 2048 columns: rows of w read eight at a time, with a K tail
]


@needs_kernel
@pytest.mark.parametrize("rows, num_experts, k, n, experts", _EXPERT_CASES)
def test_expert_matmul_matches_float64(rows, num_experts, k, n, experts):
  assert cpu_gemm.load()
  rng = np.random.default_rng(rows * 100 + k)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = rng.standard_normal((num_experts, k, n)).astype(np.float32)
  ids = np.asarray(experts if experts is not None else rng.integers(0, num_experts, rows), np.int32)
  _close(jax.jit(cpu_gemm.expert_matmul)(x, w, ids), _expert_reference(x, w, ids))


@needs_kernel
def test_expert_matmul_fails_the_program_on_an_expert_id_out_of_range():
  assert cpu_gemm.load()
  x, w = np.ones((2, 8), np.float32), np.ones((3, 8, 4), np.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"expert id is outside \[0, E\)"):
    jax.block_until_ready(jax.jit(cpu_gemm.expert_matmul)(x, w, np.asarray([0, 3], np.int32)))


@pytest.mark.parametrize(
    "x, w, experts, match",
    [
        (jnp.zeros((2, 4)), jnp.zeros((4, 5)), jnp.zeros((2,), jnp.int32), r"w \[E, K, N\].*w \(4, 5\)"),
        (jnp.zeros((2, 4)), jnp.zeros((3, 5, 6)), jnp.zeros((2,), jnp.int32), r"got x \(2, 4\), w \(3, 5, 6\)"),
        (jnp.zeros((2, 4)), jnp.zeros((3, 4, 6)), jnp.zeros((3,), jnp.int32), r"experts \(3,\)"),
        (jnp.zeros((2, 4)), jnp.zeros((3, 4, 6)), jnp.zeros((2,)), r"int32 experts; got float32, float32 and float32"),
        (
            jnp.zeros((2, 4), jnp.bfloat16),
            jnp.zeros((3, 4, 6)),
            jnp.zeros((2,), jnp.int32),
            r"got bfloat16, float32 and int32",
        ),
    ],
)
def test_expert_matmul_rejects_what_the_kernel_cannot_take(x, w, experts, match):
  with pytest.raises(ValueError, match=match):
    cpu_gemm.expert_matmul(x, w, experts)


@needs_kernel
@pytest.mark.parametrize("rows, num_experts, k, n, experts", _EXPERT_CASES)
def test_expert_matmuls_match_float64_and_each_product_alone(rows, num_experts, k, n, experts):
  """Two products of one routing in one call (a second N of a different width): each equals `expert_matmul`'s
  result bit for bit and the float64 product within the kernel's tolerance."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(rows * 100 + k + 1)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  ws = (
      rng.standard_normal((num_experts, k, n)).astype(np.float32),
      rng.standard_normal((num_experts, k, n // 2 + 3)).astype(np.float32),
  )
  ids = np.asarray(experts if experts is not None else rng.integers(0, num_experts, rows), np.int32)
  got = jax.jit(cpu_gemm.expert_matmuls)(x, ws, ids)
  assert len(got) == 2
  for w, y in zip(ws, got):
    np.testing.assert_array_equal(y, jax.jit(cpu_gemm.expert_matmul)(x, w, ids))
    _close(y, _expert_reference(x, w, ids))


@needs_kernel
def test_expert_matmuls_fail_the_program_on_an_expert_id_out_of_range():
  assert cpu_gemm.load()
  x, w = np.ones((2, 8), np.float32), np.ones((3, 8, 4), np.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"expert id is outside \[0, E\)"):
    jax.block_until_ready(jax.jit(cpu_gemm.expert_matmuls)(x, (w, w), np.asarray([0, 3], np.int32)))


@pytest.mark.parametrize(
    "ws, match",
    [
        ((), r"one or more w, got none"),
        ((jnp.zeros((3, 4, 6)), jnp.zeros((3, 5, 6))), r"ws\[1\]: .*got x \(2, 4\), w \(3, 5, 6\)"),
        ((jnp.zeros((3, 4, 6)), jnp.zeros((3, 4, 6), jnp.bfloat16)), r"ws\[1\]: .*got float32, bfloat16 and int32"),
        ((jnp.zeros((3, 4, 6)), jnp.zeros((5, 4, 6))), r"one expert count; ws\[0\] has 3, ws\[1\] 5"),
    ],
)
def test_expert_matmuls_reject_what_the_kernel_cannot_take(ws, match):
  with pytest.raises(ValueError, match=match):
    cpu_gemm.expert_matmuls(jnp.zeros((2, 4)), ws, jnp.zeros((2,), jnp.int32))


def test_to_panels_puts_columns_in_contiguous_panels():
  """Panel t holds columns [32 t, 32 t + 32) row by row, built here by NumPy slicing."""
  w = np.arange(5 * 96, dtype=np.float32).reshape(5, 96)
  panels = np.asarray(cpu_gemm.to_panels(jnp.asarray(w)))
  assert panels.shape == (3, 5, 32) and panels.flags.c_contiguous
  for t in range(3):
    np.testing.assert_array_equal(panels[t], w[:, 32 * t : 32 * t + 32])
  np.testing.assert_array_equal(np.asarray(cpu_gemm.from_panels(jnp.asarray(panels))), w)
  np.testing.assert_array_equal(np.asarray(jax.jit(cpu_gemm.to_panels)(jnp.asarray(w))), panels)  # traced: XLA's
  abstract = cpu_gemm.to_panels(jax.ShapeDtypeStruct((5, 96), jnp.float32))
  assert abstract == jax.ShapeDtypeStruct((3, 5, 32), jnp.float32)


@pytest.mark.parametrize(
    "fn, operand, match",
    [
        (cpu_gemm.to_panels, jnp.zeros((4, 48)), r"N a multiple of 32, got shape \(4, 48\)"),
        (cpu_gemm.to_panels, jnp.zeros((4, 2, 32)), r"2-D \[K, N\] weight .* got shape \(4, 2, 32\)"),
        (cpu_gemm.from_panels, jnp.zeros((2, 4, 16)), r"shape \[N / 32, K, 32\], got \(2, 4, 16\)"),
        (cpu_gemm.from_panels, jnp.zeros((4, 32)), r"shape \[N / 32, K, 32\], got \(4, 32\)"),
    ],
)
def test_panels_reject_other_shapes(fn, operand, match):
  with pytest.raises(ValueError, match=match):
    fn(operand)


@needs_kernel
@pytest.mark.parametrize("m", [1, 5])
def test_matmuls_take_panels_and_row_major_side_by_side(m):
  """Each result of one call with both layouts equals its product alone, bit for bit."""
  assert cpu_gemm.load()
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, 130)).astype(np.float32)
  ws = [rng.standard_normal((130, n)).astype(np.float32) for n in (256, 40, 64)]
  operands = [cpu_gemm.to_panels(jnp.asarray(ws[0])), ws[1], cpu_gemm.to_panels(jnp.asarray(ws[2]))]
  together = jax.jit(cpu_gemm.matmuls)(x, operands)
  for operand, w, y in zip(operands, ws, together):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_gemm.matmul)(x, operand)))
    _close(y, _reference(x, w))


@needs_kernel
def test_applies_panels_takes_any_number_of_float32_rows():
  assert [cpu_gemm.applies_panels(r, jnp.float32) for r in (0, 1, 9, 4096)] == [False, True, True, True]
  assert not cpu_gemm.applies_panels(9, jnp.bfloat16)


@pytest.mark.parametrize(
    "x, w, match",
    [
        (jnp.zeros((2, 4)), jnp.zeros((2, 4, 16)), r"shape \[N / 32, K, 32\], got \(2, 4, 16\)"),
        (jnp.zeros((2, 3, 4)), jnp.zeros((2, 4, 32)), r"takes a 2-D x, got x \(2, 3, 4\)"),
        (jnp.zeros((2, 5)), jnp.zeros((2, 4, 32)), r"x \(2, 5\) and w \(2, 4, 32\) \(nn\) do not share their inner"),
    ],
)
def test_matmul_rejects_bad_panels(x, w, match):
  with pytest.raises(ValueError, match=match):
    cpu_gemm.matmul(x, w)


@needs_kernel
def test_kernel_checks_the_panel_width():
  """The library's own check, reached by calling its target directly (`matmul` checks first)."""
  assert cpu_gemm.load()
  call = jax.ffi.ffi_call(cpu_gemm.TARGETS["nn"][0], jax.ShapeDtypeStruct((2, 32), jnp.float32))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"column panels must be 32 columns wide"):
    jax.block_until_ready(jax.jit(call)(np.ones((2, 4), np.float32), np.ones((2, 4, 16), np.float32)))
