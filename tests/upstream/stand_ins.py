"""The four stand-ins that let tpu-inference 0.32.0's real runner run on a CPU device, and nothing else.

tpu-inference refuses a CPU device in exactly four places; everything else the upstream tier runs (vLLM's engine,
scheduler and KV-cache planning, tpu-inference's worker, runner, model loader, KV-cache manager, input batch and
jitted step) is the released code, unchanged. Each stand-in replaces one upstream function, in the module that
defines it and in every already-imported module that bound it by name:

1. `tpu_inference/utils.py::make_optimized_mesh` sorts the devices by `.coords`, which only TPU devices have
   (reached from `runner/tpu_runner.py::_create_2d_mesh`). Stand-in: a plain `jax.sharding.Mesh` over the devices in
   their given order, with the same shape and axis names.
2. `tpu_inference/utils.py::get_device_hbm_limit` raises "Expected TPU devices" through `get_device_name`, because a
   CPU device has no `memory_stats()` and the worker then sizes the KV cache from live arrays and the device-kind
   HBM limit (`hbm_usage_bytes` -> `pathways_hbm_usage_gb`). Stand-in: a fixed limit, `HBM_LIMIT_BYTES`.
3. `tpu_inference/models/common/compiler_options.py::get_step_fn_compiler_options` and
   `get_sampling_compiler_options` return `xla_tpu_*` options that the CPU compiler rejects ("No such compile
   option"). `layers/jax/sample/sampling.py` jits `sample()` with them when it is imported, so these are replaced
   before that import. Stand-in: no options.
4. `tpu_inference/layers/common/utils.py::general_device_put`: on the CPU, `jax.device_put` of an aligned NumPy
   array may alias the array's memory instead of copying it, and the runner refills its NumPy input buffers while a
   dispatched step may still read them, which corrupts tokens. On a TPU the put always copies to device memory.
   Stand-in: copy NumPy inputs first, then the original function.

`install()` must run before vLLM or tpu-inference modules other than these are imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

HBM_LIMIT_BYTES = 8 << 30

# What tpu-inference and libtpu would otherwise ask a cloud metadata server by host name at import (tpu_info.py
# reads these before polling; libtpu reads TPU_SKIP_MDS_QUERY).
NO_METADATA_SERVER_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "cpu-stand-in",
    "TPU_NAME": "cpu-stand-in",
    "TPU_WORKER_ID": "0",
}
# The engine core in this process (so the stand-ins reach the worker), no precompilation of every bucket.
RUNNER_ENV = {
    "JAX_PLATFORMS": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "SKIP_JAX_PRECOMPILE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def environment() -> dict[str, str]:
  """The environment variables the tier sets before importing vLLM or tpu-inference."""
  return {**NO_METADATA_SERVER_ENV, **RUNNER_ENV}


def cpu_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, devices: Sequence[Any] | None = None):
  """Stands in for `tpu_inference.utils.make_optimized_mesh` (TPU-only device sort by `.coords`)."""
  import jax  # pylint: disable=import-outside-toplevel  # after the environment is set

  devices = list(jax.devices() if devices is None else devices)
  count = int(np.prod(axis_shapes))
  return jax.sharding.Mesh(np.array(devices[:count]).reshape(tuple(axis_shapes)), tuple(axis_names))


def fixed_hbm_limit() -> int:
  """Stands in for `tpu_inference.utils.get_device_hbm_limit` (raises on a device that is not a TPU)."""
  return HBM_LIMIT_BYTES


def no_compiler_options() -> dict[str, str]:
  """Stands in for tpu-inference's step and sampling compiler options (`xla_tpu_*`, rejected by the CPU)."""
  return {}


def _copying_device_put(original: Callable[..., Any]) -> Callable[..., Any]:
  def general_device_put(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for `tpu_inference.layers.common.utils.general_device_put`: copies NumPy inputs first."""
    if isinstance(tensor, np.ndarray):
      tensor = tensor.copy()
    elif isinstance(tensor, (tuple, list)):
      tensor = type(tensor)(t.copy() if isinstance(t, np.ndarray) else t for t in tensor)
    return original(tensor, *args, **kwargs)

  general_device_put.stands_in_for = original
  return general_device_put


def _rebind(original: Any, replacement: Any) -> int:
  """Points every loaded tpu_inference/vllm module's global that is `original` at `replacement`."""
  count = 0
  for name, module in list(sys.modules.items()):
    if module is None or not name.startswith(("tpu_inference", "vllm")):
      continue
    for attr, value in list(vars(module).items()):
      if value is original:
        setattr(module, attr, replacement)
        count += 1
  return count


_INSTALLED: list[bool] = []  # one process-wide installation


def install() -> None:
  """Sets the environment and replaces the four functions; idempotent."""
  if _INSTALLED:
    return
  os.environ.update(environment())
  # pylint: disable=import-outside-toplevel  # the environment must be set first
  from tpu_inference.models.common import compiler_options

  for fn in ("get_step_fn_compiler_options", "get_sampling_compiler_options"):
    _rebind(getattr(compiler_options, fn), no_compiler_options)
  import tpu_inference.utils as tpu_utils
  from tpu_inference.layers.common import utils as layer_utils

  _rebind(tpu_utils.make_optimized_mesh, cpu_mesh)
  _rebind(tpu_utils.get_device_hbm_limit, fixed_hbm_limit)
  original_put = layer_utils.general_device_put
  _rebind(original_put, _copying_device_put(original_put))
  _INSTALLED.append(True)
