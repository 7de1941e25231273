"""The released tpu-inference wheel as test material: fetched once into a cache dir, never imported as a package.

tpu-inference cannot be imported here (its package `__init__` needs vLLM, torchax and jax 0.11.2), but a few of
its files stand alone: the pure-JAX reference kernels the conformance tests compare against, and the KV cache
manager that docs/tpu-inference-kv-cache-spec.patch must still apply to. `fetch_wheel_source` downloads the wheel
with pip (`pip download --no-deps --only-binary=:all:`) and unpacks it under `~/.cache/maxtext/` (or
`$MAXTEXT_CACHE_DIR`); `load_references` loads the reference files by path, giving each sibling module it imports
a module entry of its own only while it loads. Concurrent callers (parallel test workers) take a file lock in the
cache dir, so the wheel is downloaded and unpacked by one of them while the others wait and then reuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from typing import Any, Callable
from unittest import mock

from maxtext import user_cache

TPU_INFERENCE_VERSION = "0.32.0"
KV_CACHE_MANAGER = "tpu_inference/runner/kv_cache_manager.py"
_RPA_DIR = "tpu_inference/kernels/ragged_paged_attention/v3"
_RPA_PACKAGE = "tpu_inference.kernels.ragged_paged_attention.v3"
_PIP_TIMEOUT_S = 600


def cache_dir() -> pathlib.Path:
  """Where the wheel and its unpacked files are kept: `$MAXTEXT_CACHE_DIR`, else `~/.cache/maxtext`."""
  return user_cache.folder(f"tpu-inference-{TPU_INFERENCE_VERSION}")


def fetch_wheel_source(root: pathlib.Path | None = None) -> pathlib.Path:
  """Downloads (once) and unpacks (once) the tpu-inference wheel; returns the directory holding `tpu_inference/`.

  Raises:
    RuntimeError: pip could not download the wheel (the message carries pip's output).
  """
  root = cache_dir() if root is None else pathlib.Path(root)
  source = root / "src"
  if (source / KV_CACHE_MANAGER).is_file():
    return source
  root.mkdir(parents=True, exist_ok=True)
  with _locked(root / ".lock"):
    if not (source / KV_CACHE_MANAGER).is_file():  # another process may have unpacked it while this one waited
      _download_and_unpack(root, source)
  return source


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """Holds an exclusive `flock` on `path` (created if missing) for the duration of the block."""
  with open(path, "a", encoding="utf-8") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def _download_and_unpack(root: pathlib.Path, source: pathlib.Path) -> None:
  """Downloads the wheel into `root` unless it is there, then unpacks it into `source`; the caller holds the lock."""
  wheels = sorted(root.glob(f"tpu_inference-{TPU_INFERENCE_VERSION}-*.whl"))
  if not wheels:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [f"tpu-inference=={TPU_INFERENCE_VERSION}", "-d", str(root)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    wheels = sorted(root.glob(f"tpu_inference-{TPU_INFERENCE_VERSION}-*.whl"))
    if done.returncode != 0 or not wheels:
      raise RuntimeError(
          f"could not download tpu-inference=={TPU_INFERENCE_VERSION} into {root} "
          f"(pip exit {done.returncode}): {done.stderr.strip()[-2000:]}"
      )
  # Unpack next to the final place, then rename, so an interrupted run never leaves a half-filled `src`.
  staging = pathlib.Path(tempfile.mkdtemp(dir=root, prefix="unpack-"))
  with zipfile.ZipFile(wheels[0]) as wheel:
    wheel.extractall(staging)
  shutil.rmtree(source, ignore_errors=True)
  staging.rename(source)


def _load_file(path: pathlib.Path, name: str) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def _only_for_the_pallas_kernel(*args: Any, **kwargs: Any) -> Any:
  """Stands in for the hd64 kernel's block-size table, which only the TPU kernel (never the reference) reads."""
  raise NotImplementedError(f"tuned block sizes are read by the Pallas kernel only (args {args}, {kwargs})")


@dataclasses.dataclass(frozen=True)
class References:
  """The wheel's pure-JAX reference functions."""

  ragged_paged_attention: Callable[..., Any]  # kernel.py::ref_ragged_paged_attention
  ragged_paged_attention_hd64: Callable[..., Any]  # kernel_hd64.py::ref_ragged_paged_attention_hd64
  ragged_gated_delta_rule: Callable[..., Any]  # kernels/gdn/reference/ragged_gated_delta_rule_ref.py
  ragged_conv1d: Callable[..., Any]  # layers/common/ragged_conv1d_jax.py


def load_references(source: pathlib.Path) -> References:
  """Loads the reference kernels from the unpacked wheel without running any tpu-inference `__init__`.

  `kernel.py` and `kernel_hd64.py` import their sibling `util.py` (loaded from the wheel too); `kernel_hd64.py`
  also imports a tuned block-size table whose module needs the whole package, so it gets a minimal entry whose
  only function refuses to run. `sys.modules` is restored afterwards.
  """
  source = pathlib.Path(source)
  tuned_name = f"{_RPA_PACKAGE}.tuned_block_sizes_hd64"
  tuned = types.ModuleType(tuned_name)
  tuned.get_tuned_block_sizes = _only_for_the_pallas_kernel
  with mock.patch.dict(sys.modules, {tuned_name: tuned}):
    _load_file(source / _RPA_DIR / "util.py", f"{_RPA_PACKAGE}.util")
    rpa = _load_file(source / _RPA_DIR / "kernel.py", f"{_RPA_PACKAGE}.kernel")
    rpa_hd64 = _load_file(source / _RPA_DIR / "kernel_hd64.py", f"{_RPA_PACKAGE}.kernel_hd64")
    gdn = _load_file(
        source / "tpu_inference/kernels/gdn/reference/ragged_gated_delta_rule_ref.py",
        "tpu_inference.kernels.gdn.reference.ragged_gated_delta_rule_ref",
    )
    conv = _load_file(
        source / "tpu_inference/layers/common/ragged_conv1d_jax.py", "tpu_inference.layers.common.ragged_conv1d_jax"
    )
  return References(
      ragged_paged_attention=rpa.ref_ragged_paged_attention,
      ragged_paged_attention_hd64=rpa_hd64.ref_ragged_paged_attention_hd64,
      ragged_gated_delta_rule=gdn.ragged_gated_delta_rule,
      ragged_conv1d=conv.ragged_conv1d,
  )
