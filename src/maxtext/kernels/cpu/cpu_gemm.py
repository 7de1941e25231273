"""Small-batch matrix products on x86-64 CPUs (float32 activations; float32 or bfloat16 weights, summed in float32):
an AVX2 kernel called from XLA programs through XLA's FFI.

A decode step multiplies one row per request by every weight matrix. XLA's CPU dot packs the weight matrix on every
call, so with 2 to 8 rows it reads weights at well under the memory bandwidth, and its matrix-vector path for one
row reads about two thirds of it. `cpu/small_gemm.cc` reads each weight once, in place: 2 to 8 rows in the lanes
of a vector register, one row as one front-to-back stream per slice of the matrix's rows, and splits the work
between the calling thread and the library's helper threads (`cpu/parallel.h`). Routed experts
have a third product, `expert_matmul`: each (token, choice) row times its expert's matrix, read where it lies in
the stacked `[E, K, N]` weights (XLA copies a matrix it slices out of them before multiplying). `matmuls` runs
several products of one input (a block's projections, through the backend's `project`) in one call, and
`expert_matmuls` several expert products of one routing (an expert's gate and up). The NN products also
take a weight in column panels (`to_panels`, `[N / PANEL, K, PANEL]`, how the `cpu` backend stores the dense kernels:
`CpuBackend.prepare_params`), read a panel at a time at any number of rows, a prefill's included, and weight-only
int8 panels (`to_int8_panels`), read with AVX-512 VNNI's integer dot products where the CPU has them
(`INT8_DOT_CPU_FLAGS`, `cpu/int8_dot.h`).

The same library holds the paged attention handler (`cpu/paged_attention.cc`), which `cpu_attention.py` serves,
the gated delta rule's recurrence (`cpu/gated_delta.cc`), which `cpu_gated_delta.py` serves, and Mamba2's
(`cpu/mamba2.cc`), which `cpu_mamba2.py` serves; both run on `cpu/ragged_state.h`.

The kernel is C++ shipped as source: `load()` compiles it once per source, JAX version, compiler and CPU flags
(`compile_flags`) into `kernels/` under this package's cache folder (`$MAXTEXT_CACHE_DIR`, else `~/.cache/maxtext`)
with the system C++ compiler and JAX's FFI headers, then registers its handlers with XLA. Without a compiler, on
another CPU, or when the build fails, `load()` says why once in the log and XLA's dot is used: the kernel is an
optimisation, never a requirement.

Only the `cpu` kernel backend (`backend.CpuBackend`) calls `matmul` / `matmuls` / `matmul_transposed` /
`expert_matmul(s)`, for the products `applies*` accept; every other product, and every other backend, stays an XLA dot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext import user_cache

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# One library; the headers are shared.
SOURCES = tuple(
    SOURCE_DIR / name for name in ("small_gemm.cc", "expert_gemm.cc", "paged_attention.cc", "gated_delta.cc", "mamba2.cc")
)
HEADERS = tuple(SOURCE_DIR / name for name in ("gemm_rows.h", "int8_dot.h", "parallel.h", "simd.h", "ragged_state.h"))
# Rows of x the small-batch products take (one row is a matrix-vector product); steps of up to this many tokens
# compile without YNNPACK's fusions (`small_batch_compiler_options`).
MAX_ROWS = 8
MAX_EXPERT_ROWS = 1024  # (token, choice) rows up to which the routed experts run on the kernel
PANEL = 32  # columns per panel of a weight in column panels (`to_panels`; cpu/small_gemm.cc's kPanel)
# Weights up to this many columns go into panels (`CpuBackend.prepare_params`). A wider one (an untied output head, 32000
# columns) reads as fast row-major at one row and faster at 8 rows, where the kernel cuts it into column chunks.
MAX_PANEL_COLUMNS = 8192
# Weight dtypes the NN and NT products read (x and y are float32): bfloat16 is widened to float32 in registers, so a
# weight-only bfloat16 model reads half the bytes per token and sums in float32.
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Weight-only int8 (`to_int8_panels`): blocks of PANEL rows (along K) of a panel, one float32 scale per (block, column),
# packed per block as its PANEL x PANEL int8 weights (row by row) and then its PANEL scales: INT8_BLOCK bytes.
INT8_BLOCK = PANEL * PANEL + 4 * PANEL
INT8_CHUNK_VALUES = 1 << 20  # weights `to_int8_panels` quantizes at a time (whole panels, at least one)
# Int4 panels (`to_int4_panels`): the same blocks, their weights as nibbles (PANEL * PANEL / 2 bytes) and then PANEL
# float16 scales: INT4_BLOCK bytes. Only a library with the integer dot products reads them (`int8_dot_reason`).
INT4_BLOCK = PANEL * PANEL // 2 + 2 * PANEL
INT4_LEVELS = 7  # |q| <= 7: a block's largest magnitude is 7 scale steps
# Every dtype a weight reaches the NN kernel in: uint8 only as int8 panels.
KERNEL_DTYPES = WEIGHT_DTYPES + (jnp.dtype(jnp.uint8),)
TARGETS = {
    "nn": ("maxtext_small_gemm_nn", "MaxtextSmallGemmNN"),
    "nt": ("maxtext_small_gemm_nt", "MaxtextSmallGemmNT"),
    "nn_many": ("maxtext_small_gemm_nn_many", "MaxtextSmallGemmNNMany"),
    "experts": ("maxtext_expert_gemm", "MaxtextExpertGemm"),
    "experts_many": ("maxtext_expert_gemm_many", "MaxtextExpertGemmMany"),
    "attention": ("maxtext_paged_attention", "MaxtextPagedAttention"),  # served by cpu_attention.py
    "gated_delta": ("maxtext_gated_delta", "MaxtextGatedDelta"),  # served by cpu_gated_delta.py
    "mamba2": ("maxtext_mamba2", "MaxtextMamba2"),  # served by cpu_mamba2.py
}
_FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")
# The CPU flags (`/proc/cpuinfo` names) the integer products of int8 panels need (`cpu/int8_dot.h`: AVX-512 VNNI's
# byte dot products, VBMI's byte permutes), and the compiler flags that enable them. The library is built with them
# when the CPU has all four; int8 panels are then read with x rounded per row and block of PANEL values to 16-bit
# integers, |q| <= INT8_DOT_LEVELS (q = round(x * INT8_DOT_LEVELS / the block's largest magnitude)), and the int8
# products summed exactly. Without them, int8 panels are widened to float32 and x is read as it is.
INT8_DOT_CPU_FLAGS = {
    "avx512f": "-mavx512f",
    "avx512bw": "-mavx512bw",
    "avx512_vnni": "-mavx512vnni",
    "avx512vbmi": "-mavx512vbmi",
}
INT8_DOT_LEVELS = 32639
# XLA's CPU compiler hands element-wise and reduction fusions to YNNPACK. In a decode step of a few rows those
# fusions (the attention's scores, softmax and weighted sum; a Gated DeltaNet's conv) work on a few thousand elements
# each and cost more per call than XLA's own loops. Programs of 1-8 rows compile without them.
_SMALL_BATCH_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def cache_dir() -> Path:
  """Where compiled kernels are kept: `kernels/` in `$MAXTEXT_CACHE_DIR`, else in `~/.cache/maxtext`.

  The same cache folder and variable as the other files this package keeps (the tests' tpu-inference wheel).
  """
  return user_cache.folder("kernels")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
  """The CPU's feature flags from `$MAXTEXT_CPUINFO` (a file in `/proc/cpuinfo`'s format; default `/proc/cpuinfo`),
  or from the given text; empty when they cannot be read."""
  if cpuinfo is None:
    try:
      cpuinfo = Path(os.environ.get("MAXTEXT_CPUINFO") or "/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
      return set()
  for line in cpuinfo.splitlines():
    if line.startswith("flags"):
      return set(line.partition(":")[2].split())
  return set()


def unsupported_reason(machine: str | None = None, flags: set[str] | None = None) -> str | None:
  """Why this CPU cannot run the kernel (it needs x86-64 with AVX2 and FMA), or None when it can."""
  machine = platform.machine() if machine is None else machine
  if machine.lower() not in ("x86_64", "amd64"):
    return f"the CPU is {machine}, not x86-64"
  flags = cpu_flags() if flags is None else flags
  missing = sorted({"avx2", "fma"} - flags)
  return f"the CPU lacks {', '.join(missing)}" if missing else None


def int8_dot_reason(flags: set[str] | None = None) -> str | None:
  """Why the library for this CPU reads int8 panels without integer dot products (it lacks some of
  `INT8_DOT_CPU_FLAGS`), or None when it reads them with."""
  flags = cpu_flags() if flags is None else flags
  missing = sorted(set(INT8_DOT_CPU_FLAGS) - flags)
  return f"the CPU lacks {', '.join(missing)}" if missing else None


def compile_flags(flags: set[str] | None = None) -> tuple[str, ...]:
  """The compiler flags of the library for a CPU with these flags (default this one's): `INT8_DOT_CPU_FLAGS`'
  when it has them all."""
  if int8_dot_reason(flags) is not None:
    return _FLAGS
  return _FLAGS + tuple(INT8_DOT_CPU_FLAGS.values())


def build(compiler: str | None = None, folder: Path | None = None) -> Path:
  """Compiles the kernels' sources (`SOURCES`) into one shared library, or returns the one compiled before.

  The file name carries a hash of the sources, the flags (`compile_flags`: they follow the CPU), the compiler and
  the JAX version, so a change of any of them builds anew. The library is written under a temporary name and
  renamed into place, so processes building
  at the same time (test workers) never load a partial file.

  Args:
    compiler: the C++ compiler; default `$CXX`, else the first of `c++` and `g++` on the PATH.
    folder: where libraries are kept; default `cache_dir()`.

  Returns:
    The library's path.

  Raises:
    RuntimeError: no C++ compiler is found, or it fails (the message holds its first error lines).
  """
  compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not compiler:
    raise RuntimeError("no C++ compiler found (set CXX, or install g++) to build the small-batch matmul kernel")
  folder = cache_dir() if folder is None else folder
  include = jax.ffi.include_dir()
  flags = compile_flags()
  key = hashlib.sha256()
  for part in (
      *(f.read_bytes() for f in SOURCES + HEADERS),
      " ".join(flags).encode(),
      compiler.encode(),
      jax.__version__.encode(),
  ):
    key.update(part)
  path = folder / f"maxtext_cpu-{key.hexdigest()[:16]}.so"
  if path.exists():
    return path
  folder.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=folder) as tmp:
    partial = Path(tmp) / path.name
    command = [compiler, *flags, f"-I{include}", "-o", str(partial), *map(str, SOURCES)]
    try:
      result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise RuntimeError(f"cannot run the C++ compiler {compiler!r}: {e}") from e
    if result.returncode != 0:
      first_lines = " | ".join(result.stderr.strip().splitlines()[:3])
      names = ", ".join(f.name for f in SOURCES)
      raise RuntimeError(f"{compiler} failed (exit status {result.returncode}) building {names}: {first_lines}")
    os.replace(partial, path)
  return path


@functools.cache
def load() -> bool:
  """Builds and registers the kernel once per process; returns whether it is available.

  Returns False, with the reason logged once as a warning, when the CPU cannot run it or it cannot be built.
  """
  reason = unsupported_reason()
  library = None
  if reason is None:
    try:
      library = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
      reason = str(e)
  if library is None:
    logger.warning("small-batch CPU matmul kernel not used (XLA's dot is): %s", reason)
    return False
  for target, symbol in TARGETS.values():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
  return True


@functools.cache
def small_batch_compiler_options() -> dict[str, str]:
  """XLA compile options for the decode programs the kernel serves (1-8 rows): YNNPACK's fusions off.

  Returns:
    The options, or {} (logged once) when this jaxlib does not know them.
  """
  try:
    jax.jit(lambda x: x + 1, compiler_options=_SMALL_BATCH_OPTIONS).lower(jnp.zeros((2,))).compile()
  except jax.errors.JaxRuntimeError as e:
    logger.warning("small-batch programs keep XLA's default fusions: %s", e)
    return {}
  return dict(_SMALL_BATCH_OPTIONS)


def small_batch_program(num_tokens: int) -> bool:
  """Whether the engine compiles a step of `num_tokens` (padded) tokens with `small_batch_compiler_options` when the
  kernel serves it: 1 to `MAX_ROWS`. Code whose best form depends on YNNPACK's fusions asks it too."""
  return 1 <= num_tokens <= MAX_ROWS


def applies(rows: int, x_dtype: jnp.dtype, *w_dtypes: jnp.dtype) -> bool:
  """Whether a product of `rows` rows of `x` with weights of these dtypes should use the kernel.

  True for 1 to 8 rows of float32 `x` and weights in `KERNEL_DTYPES` (uint8: int8 panels), once `load()` has
  succeeded.
  """
  return _serves(rows, 1, MAX_ROWS, x_dtype, w_dtypes, KERNEL_DTYPES)


def applies_panels(rows: int, x_dtype: jnp.dtype, *w_dtypes: jnp.dtype) -> bool:
  """Whether a product of `rows` rows of `x` with weights in column panels should use the kernel.

  True for float32 `x`, weights in `KERNEL_DTYPES` (uint8: int8 panels) and any number of rows (the kernel reads
  each panel from memory once, 8 rows at a time), once `load()` has succeeded.
  """
  return _serves(rows, 1, rows, x_dtype, w_dtypes, KERNEL_DTYPES)


def applies_experts(rows: int, *dtypes: jnp.dtype) -> bool:
  """Whether routed experts over `rows` (token, choice) rows should use `expert_matmul`.

  True for 1 to `MAX_EXPERT_ROWS` rows of float32 operands, once `load()` has succeeded.
  """
  return _serves(rows, 1, MAX_EXPERT_ROWS, jnp.float32, dtypes, (jnp.dtype(jnp.float32),))


def _serves(rows: int, low: int, high: int, x_dtype, w_dtypes, allowed) -> bool:
  dtypes_fit = jnp.dtype(x_dtype) == jnp.float32 and all(jnp.dtype(d) in allowed for d in w_dtypes)
  return low <= rows <= high and dtypes_fit and load()


def to_panels(w: jax.Array) -> jax.Array:
  """`w [K, N]` in column panels `[N / PANEL, K, PANEL]`: panel t holds columns `[t * PANEL, (t + 1) * PANEL)`, row by
  row, one contiguous stretch of memory.

  `matmul` and `matmuls` take a weight in either layout. In panels a task reads whole panels front to back, one row
  of x summing a panel's columns in registers: faster at 1 to 8 rows than row-major `[K, N]` (docs/architecture.md,
  "Weights in column panels"). Works on a `jax.ShapeDtypeStruct` too (the shape only).

  Raises:
    ValueError: `w` is not 2-D, or N is not a multiple of `PANEL`.
  """
  if len(w.shape) != 2 or w.shape[1] % PANEL:
    raise ValueError(f"column panels take a 2-D [K, N] weight with N a multiple of {PANEL}, got shape {w.shape}")
  k, n = w.shape
  if isinstance(w, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((n // PANEL, k, PANEL), w.dtype)
  if isinstance(w, jax.core.Tracer):
    return jnp.transpose(w.reshape(k, n // PANEL, PANEL), (1, 0, 2))
  # A concrete array (the engine converting loaded weights) is copied by NumPy and moved by `device_put`: an eager
  # XLA transpose, or `jnp.asarray`, would compile a program per shape during the load.
  return jax.device_put(np.ascontiguousarray(np.asarray(w).reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)))


def from_panels(panels: jax.Array) -> jax.Array:
  """The `[K, N]` weight of column panels `[N / PANEL, K, PANEL]` (`to_panels`'s inverse), a copy.

  Only a product outside the kernel's reach needs it (the `cpu` backend sends every float32 product in panels to the
  kernel, at any number of rows).

  Raises:
    ValueError: `panels` is not 3-D with a last axis of `PANEL`.
  """
  _check_panels(panels)
  count, k, _ = panels.shape
  return jnp.transpose(panels, (1, 0, 2)).reshape(k, count * PANEL)


def to_int8_panels(w: Any) -> Any:
  """`w [K, N]` (float32 or bfloat16) as weight-only int8 column panels, uint8 `[N / PANEL, K / PANEL, INT8_BLOCK]`.

  Block b of panel t covers rows `[PANEL b, PANEL b + PANEL)` and columns `[PANEL t, PANEL t + PANEL)`: each column's
  scale is the block's largest magnitude in it over 127 (1 for an all-zero column) and its weights are rounded to
  the nearest multiple of the scale, in [-127, 127]. The block is stored as its int8 weights, row by row, then the
  float32 scales. Works on a `jax.ShapeDtypeStruct` (the shape only) and on concrete arrays (with NumPy, in place of
  an XLA program per shape, a few panels at a time: a bfloat16 `w` is never held whole in float32).

  Raises:
    ValueError: `w` is not 2-D with K and N multiples of `PANEL`.
  """
  if len(w.shape) != 2 or w.shape[0] % PANEL or w.shape[1] % PANEL:
    raise ValueError(f"int8 panels take a 2-D [K, N] weight with K and N multiples of {PANEL}, got shape {w.shape}")
  k, n = w.shape
  if isinstance(w, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((n // PANEL, k // PANEL, INT8_BLOCK), jnp.uint8)
  w = np.asarray(w)
  packed = np.empty((n // PANEL, k // PANEL, INT8_BLOCK), np.uint8)
  step = max(1, INT8_CHUNK_VALUES // (k * PANEL))  # panels per chunk
  for first in range(0, n // PANEL, step):
    columns = w[:, first * PANEL : (first + step) * PANEL]
    count = columns.shape[1] // PANEL
    blocks = (
        np.asarray(columns, np.float32).reshape(k // PANEL, PANEL, count, PANEL).transpose(2, 0, 1, 3)
    )  # [T, B, k, c]
    amax = np.max(np.abs(blocks), axis=2)  # [T, B, c]
    # Contiguous, so that the bytes can be viewed whatever the memory order of `w` (a transposed view, say).
    scale = np.ascontiguousarray(np.where(amax > 0, amax / 127, 1), np.float32)
    q = np.ascontiguousarray(np.clip(np.rint(blocks / scale[:, :, None, :]), -127, 127), np.int8)
    chunk = packed[first : first + count]
    chunk[..., : PANEL * PANEL] = q.reshape(count, k // PANEL, PANEL * PANEL).view(np.uint8)
    chunk[..., PANEL * PANEL :] = scale.view(np.uint8)
  return jax.device_put(packed)


def from_int8_panels(panels: Any) -> Any:
  """The float32 `[K, N]` weight int8 panels hold (`to_int8_panels`' dequantized inverse: each weight times its
  scale). NumPy for a concrete array, XLA when traced.

  Raises:
    ValueError: `panels` is not uint8 `[N / PANEL, K / PANEL, INT8_BLOCK]`.
  """
  if panels.ndim != 3 or panels.shape[2] != INT8_BLOCK or panels.dtype != jnp.uint8:
    raise ValueError(f"int8 panels are uint8 [N / {PANEL}, K / {PANEL}, {INT8_BLOCK}], got {panels.dtype} {panels.shape}")
  count, blocks, _ = panels.shape
  if isinstance(panels, jax.core.Tracer):
    q = jax.lax.bitcast_convert_type(panels[..., : PANEL * PANEL], jnp.int8)
    scale = jax.lax.bitcast_convert_type(panels[..., PANEL * PANEL :].reshape(count, blocks, PANEL, 4), jnp.float32)
  else:
    panels = np.asarray(panels)
    q = panels[..., : PANEL * PANEL].view(np.int8)
    scale = np.ascontiguousarray(panels[..., PANEL * PANEL :]).view(np.float32)
  w = q.reshape(count, blocks, PANEL, PANEL).astype(jnp.float32) * scale.reshape(count, blocks, 1, PANEL)  # [T, B, k, c]
  return w.transpose(1, 2, 0, 3).reshape(blocks * PANEL, count * PANEL)


def to_int4_panels(w: Any) -> Any:
  """`w [K, N]` (float32 or bfloat16) as int4 column panels, uint8 `[N / PANEL, K / PANEL, INT4_BLOCK]`: a coarse
  copy, read only where the library has the integer dot products (`int8_dot_reason() is None`).

  The blocks are those of `to_int8_panels`: each column's scale is the block's largest magnitude in it over
  `INT4_LEVELS`, stored as float16 (a scale that rounds to 0 there makes its column's weights 0), and each weight is
  rounded to the nearest multiple of that float16 scale, q in [-7, 7], stored as the nibble q + 8. Group g of the
  block's rows 4g..4g+3 takes 64 bytes: byte i holds byte i of rows 4g and 4g+1 (row 4g's 32 columns, then row
  4g+1's) in its low nibble and byte i of rows 4g+2 and 4g+3 in its high one. Then the 32 float16 scales. Works on a
  `jax.ShapeDtypeStruct` (the shape only) and on concrete arrays (NumPy, a few panels at a time).

  Raises:
    ValueError: `w` is not 2-D with K and N multiples of `PANEL`.
  """
  if len(w.shape) != 2 or w.shape[0] % PANEL or w.shape[1] % PANEL:
    raise ValueError(f"int4 panels take a 2-D [K, N] weight with K and N multiples of {PANEL}, got shape {w.shape}")
  k, n = w.shape
  if isinstance(w, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((n // PANEL, k // PANEL, INT4_BLOCK), jnp.uint8)
  w = np.asarray(w)
  packed = np.empty((n // PANEL, k // PANEL, INT4_BLOCK), np.uint8)
  step = max(1, INT8_CHUNK_VALUES // (k * PANEL))  # panels per chunk
  for first in range(0, n // PANEL, step):
    columns = w[:, first * PANEL : (first + step) * PANEL]
    count = columns.shape[1] // PANEL
    blocks = (
        np.asarray(columns, np.float32).reshape(k // PANEL, PANEL, count, PANEL).transpose(2, 0, 1, 3)
    )  # [T, B, k, c]
    scale = (np.max(np.abs(blocks), axis=2) / INT4_LEVELS).astype(np.float16)  # [T, B, c]
    wide = scale.astype(np.float32)[:, :, None, :]
    q = np.where(wide > 0, np.rint(blocks / np.where(wide > 0, wide, 1)), 0)
    nibbles = (np.clip(q, -INT4_LEVELS, INT4_LEVELS) + 8).astype(np.uint8).reshape(count, k // PANEL, 8, 4, PANEL)
    low = nibbles[:, :, :, :2].reshape(count, k // PANEL, 8 * 2 * PANEL)  # rows 4g, 4g+1 of every group
    high = nibbles[:, :, :, 2:].reshape(count, k // PANEL, 8 * 2 * PANEL)  # rows 4g+2, 4g+3
    chunk = packed[first : first + count]
    chunk[..., : PANEL * PANEL // 2] = low | (high << 4)
    chunk[..., PANEL * PANEL // 2 :] = np.ascontiguousarray(scale).view(np.uint8)
  return jax.device_put(packed)


def from_int4_panels(panels: Any) -> Any:
  """The float32 `[K, N]` weight int4 panels hold (`to_int4_panels`' dequantized inverse: each weight times its
  float16 scale). NumPy for a concrete array, XLA when traced.

  Raises:
    ValueError: `panels` is not uint8 `[N / PANEL, K / PANEL, INT4_BLOCK]`.
  """
  if panels.ndim != 3 or panels.shape[2] != INT4_BLOCK or panels.dtype != jnp.uint8:
    raise ValueError(f"int4 panels are uint8 [N / {PANEL}, K / {PANEL}, {INT4_BLOCK}], got {panels.dtype} {panels.shape}")
  count, blocks, _ = panels.shape
  traced = isinstance(panels, jax.core.Tracer)
  xp = jnp if traced else np
  panels = panels if traced else np.asarray(panels)
  packed = panels[..., : PANEL * PANEL // 2].reshape(count, blocks, 8, 1, 2 * PANEL)
  nibbles = xp.concatenate([packed & 0x0F, packed >> 4], axis=3)  # [T, B, g, 2, 64]: rows 4g..4g+1, 4g+2..4g+3
  q = nibbles.reshape(count, blocks, PANEL, PANEL).astype(np.float32) - 8  # [T, B, k, c]
  raw = panels[..., PANEL * PANEL // 2 :]
  if traced:
    scale = jax.lax.bitcast_convert_type(raw.reshape(count, blocks, PANEL, 2), jnp.float16)
  else:
    scale = np.ascontiguousarray(raw).view(np.float16)
  w = q * scale.astype(np.float32).reshape(count, blocks, 1, PANEL)
  return w.transpose(1, 2, 0, 3).reshape(blocks * PANEL, count * PANEL)


def is_int8_panels(w: Any) -> bool:
  """Whether `w` is in int8 or int4 panels (a 3-D uint8 array; `to_int8_panels`, `to_int4_panels`)."""
  return len(w.shape) == 3 and jnp.dtype(w.dtype) == jnp.uint8


def _check_panels(panels: jax.Array) -> None:
  if panels.ndim != 3 or panels.shape[2] != PANEL:
    raise ValueError(f"column panels have shape [N / {PANEL}, K, {PANEL}], got {panels.shape}")


def _columns(kind: str, w: jax.Array) -> int:
  """N of a product's weight: `[K, N]` or panels (NN), `[N, K]` (NT)."""
  if kind != "nn":
    return w.shape[0]
  return w.shape[0] * PANEL if w.ndim == 3 else w.shape[1]  # panels, float or int8: [N / PANEL, ...]


def _call(kind: str, x: jax.Array, w: jax.Array) -> jax.Array:
  _check(kind, x, w)
  out = jax.ShapeDtypeStruct((x.shape[0], _columns(kind, w)), jnp.float32)
  return jax.ffi.ffi_call(TARGETS[kind][0], out)(x, w)


def _check(kind: str, x: jax.Array, w: jax.Array) -> None:
  panels = kind == "nn" and w.ndim == 3
  if panels and is_int8_panels(w):
    if w.shape[2] == INT4_BLOCK and int8_dot_reason() is not None:
      raise ValueError(f"int4 panels need the integer dot products, and {int8_dot_reason()}")
    if w.shape[2] not in (INT8_BLOCK, INT4_BLOCK):
      raise ValueError(
          f"int8 (int4) panels are uint8 [N / {PANEL}, K / {PANEL}, {INT8_BLOCK} ({INT4_BLOCK})], got {w.shape}"
      )
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] != w.shape[1] * PANEL:
      raise ValueError(f"small-batch matmul: x {x.shape} does not match int8 panels {w.shape} (K = {PANEL} * axis 1)")
    if x.dtype != jnp.float32:
      raise ValueError(f"small-batch matmul takes a float32 x, got x {x.dtype}")
    return
  if panels:
    _check_panels(w)
  elif x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"small-batch matmul takes 2-D operands, got x {x.shape} and w {w.shape}")
  if x.ndim != 2:
    raise ValueError(f"small-batch matmul takes a 2-D x, got x {x.shape}")
  if not 1 <= x.shape[0] <= (x.shape[0] if panels else MAX_ROWS):
    raise ValueError(f"small-batch matmul takes 1 to {MAX_ROWS} rows (any number with panels), got x {x.shape}")
  k_axis = 1 if panels or kind == "nt" else 0
  if x.shape[1] != w.shape[k_axis]:
    raise ValueError(f"small-batch matmul: x {x.shape} and w {w.shape} ({kind}) do not share their inner size")
  if x.dtype != jnp.float32 or w.dtype not in WEIGHT_DTYPES:
    raise ValueError(f"small-batch matmul takes a float32 x and a float32 or bfloat16 w, got x {x.dtype} and w {w.dtype}")


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w` by the kernel (call `load()` first).

  Args:
    x: `[M, K]` float32, 1 <= M <= 8 (any M >= 1 with panels).
    w: `[K, N]` float32 or bfloat16 (read as it is, summed in float32), or the same in column panels
      `[N / PANEL, K, PANEL]` (`to_panels`), or int8 panels (`to_int8_panels`, any M; with integer dot products
      where the CPU has them, `INT8_DOT_CPU_FLAGS`).

  Returns:
    `[M, N]` float32.

  Raises:
    ValueError: `x` is not a float32 2-D array of 1 to 8 rows (any with panels), `w` not a float32 or bfloat16 2-D
      array or panels, or they differ in K.
  """
  return _call("nn", x, w)


def matmuls(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """`x @ w` for every `w` in `ws`, by the kernel in one call (call `load()` first).

  The projections a layer takes from one input (queries, keys and values; gate and up) then share one call, its
  fixed cost and its threads' hand-over: each product alone is a few hundred KB to a few MB at one to 8 rows. Each
  result equals `matmul(x, w)` bit for bit.

  Args:
    x: `[M, K]` float32, 1 <= M <= 8 (any M >= 1 when every w is in panels).
    ws: one or more `[K, N_i]` float32 or bfloat16, each row-major or in column panels (`to_panels`), or int8
      panels.

  Returns:
    One `[M, N_i]` float32 per `w`.

  Raises:
    ValueError: `ws` is empty, or an operand fails `matmul`'s checks (the message names which `w`).
  """
  if not ws:
    raise ValueError("small-batch matmuls takes one or more w, got none")
  for i, w in enumerate(ws):
    try:
      _check("nn", x, w)
    except ValueError as e:
      raise ValueError(f"ws[{i}]: {e}") from None
  out = tuple(jax.ShapeDtypeStruct((x.shape[0], _columns("nn", w)), jnp.float32) for w in ws)
  return tuple(jax.ffi.ffi_call(TARGETS["nn_many"][0], out)(x, *ws))


def matmul_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w.T` by the kernel (call `load()` first): a tied output head over its `[V, D]` table.

  One row is a dot product per row of `w`, each task streaming a range of rows front to back.

  Args:
    x: `[M, K]` float32, 1 <= M <= 8.
    w: `[N, K]` float32 or bfloat16 (a weight-only bfloat16 table is read as it is, summed in float32).

  Returns:
    `[M, N]` float32.

  Raises:
    ValueError: as for `matmul`.
  """
  return _call("nt", x, w)


def expert_matmul(x: jax.Array, w: jax.Array, experts: jax.Array) -> jax.Array:
  """Row `r` of `x` times its expert's matrix `w[experts[r]]`, by the kernel, reading `w` in place (call `load()`).

  Rows of one expert are multiplied together (up to 8 at a time), so each selected matrix is read once per 8 rows;
  XLA would copy every selected matrix out of `w` first.

  Args:
    x: `[R, K]` float32.
    w: `[E, K, N]` float32, one matrix per expert.
    experts: `[R]` int32 expert ids in `[0, E)` (an id outside fails the program's execution).

  Returns:
    `[R, N]` float32.

  Raises:
    ValueError: the operands are not float32 `[R, K]`, `[E, K, N]` and int32 `[R]`.
  """
  _check_experts(x, w, experts)
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
  return jax.ffi.ffi_call(TARGETS["experts"][0], out)(x, w, experts)


def expert_matmuls(x: jax.Array, ws: Sequence[jax.Array], experts: jax.Array) -> tuple[jax.Array, ...]:
  """`expert_matmul(x, w, experts)` for every `w` in `ws`, by the kernel in one call (call `load()` first).

  A routed expert's gate and up read the same rows with the same routing: one call groups the rows by expert once
  and shares the threads' hand-over between both products. Each result equals `expert_matmul`'s bit for bit.

  Args:
    x: `[R, K]` float32.
    ws: one or more `[E, K, N_i]` float32, the same E.
    experts: `[R]` int32 expert ids in `[0, E)` (an id outside fails the program's execution).

  Returns:
    One `[R, N_i]` float32 per `w`.

  Raises:
    ValueError: `ws` is empty, the `w` disagree on E, or an operand fails `expert_matmul`'s checks (the message
      names which `w`).
  """
  if not ws:
    raise ValueError("expert matmuls takes one or more w, got none")
  for i, w in enumerate(ws):
    try:
      _check_experts(x, w, experts)
    except ValueError as e:
      raise ValueError(f"ws[{i}]: {e}") from None
    if w.shape[0] != ws[0].shape[0]:
      raise ValueError(f"expert matmuls takes w of one expert count; ws[0] has {ws[0].shape[0]}, ws[{i}] {w.shape[0]}")
  out = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32) for w in ws)
  return tuple(jax.ffi.ffi_call(TARGETS["experts_many"][0], out)(x, experts, *ws))


def _check_experts(x: jax.Array, w: jax.Array, experts: jax.Array) -> None:
  if x.ndim != 2 or w.ndim != 3 or experts.shape != (x.shape[0],) or x.shape[1] != w.shape[1]:
    raise ValueError(
        f"expert matmul takes x [R, K], w [E, K, N] and experts [R]; got x {x.shape}, w {w.shape}, experts"
        f" {experts.shape}"
    )
  if x.dtype != jnp.float32 or w.dtype != jnp.float32 or experts.dtype != jnp.int32:
    raise ValueError(
        f"expert matmul takes float32 x and w and int32 experts; got {x.dtype}, {w.dtype} and {experts.dtype}"
    )
