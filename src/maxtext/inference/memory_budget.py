"""The memory a run needs, from its config alone, against the memory the process may use.

Before anything is allocated, the engine adds the bytes of the parameters (the abstract model's shapes in
`weight_dtype`: the form they are loaded in; `quantization=int8w` panels are smaller once laid out) and of the KV
caches (the layout `dry_run=true` prints), and compares the sum with the memory available: the environment variable
`MAXTEXT_MEMORY_LIMIT_BYTES` when set, else the smaller of what the cgroup may still use (`memory.max` less
`memory.current`; cgroup v1's `memory.limit_in_bytes` less `memory.usage_in_bytes`) and the kernel's
`MemAvailable`. A run that cannot fit is refused with one line naming the figures and what to change, instead of
being killed by the kernel without a word. The step's activations and the runtime's own memory (JAX, XLA and the
compiled programs: about 0.35-0.45 GB for the tiny models) are not counted: a run that passes can still be short
of memory when the margin is thin.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import ml_collections
import numpy as np

from maxtext.checkpoint import source
from maxtext.configs import ConfigError
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.kv_cache import kv_cache_spec
from maxtext.models import flat_param_shapes

logger = logging.getLogger(__name__)

LIMIT_ENV = "MAXTEXT_MEMORY_LIMIT_BYTES"
# Random weights above this size are almost always a shape config run without its checkpoint by mistake.
RANDOM_WEIGHTS_WARNING_BYTES = 1 << 30
# (limit, current use) of cgroup v2, then v1: what the group may still use is the difference.
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)
_MEMINFO = "/proc/meminfo"
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


class InsufficientMemoryError(ConfigError):
  """The run's parameters and caches need more memory than the process may use."""


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
  """What a run's config asks for, in bytes.

  Attributes:
    param_bytes: the parameters in `weight_dtype`.
    cache_bytes: the KV caches and recurrent states.
  """

  param_bytes: int
  cache_bytes: int

  @property
  def total_bytes(self) -> int:
    """The parameters and the caches together."""
    return self.param_bytes + self.cache_bytes


def param_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of every parameter of the model of `cfg`, from the abstract model (nothing is allocated)."""
  return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in flat_param_shapes(cfg).values())


def cache_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of the KV caches and recurrent states the engine allocates for `cfg` (the `dry_run=true` total)."""
  manager = KVCacheManager(cfg, kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg))
  return sum(entry.nbytes for entry in manager.describe_slots())


def memory_need(cfg: ml_collections.FrozenConfigDict) -> MemoryNeed:
  """The parameter and cache bytes of `cfg`."""
  return MemoryNeed(param_bytes(cfg), cache_bytes(cfg))


def _weights(cfg: ml_collections.FrozenConfigDict) -> str:
  return "from the checkpoint" if source.names_checkpoint(cfg) else "random, no checkpoint"


def format_need(cfg: ml_collections.FrozenConfigDict, need: MemoryNeed) -> str:
  """One line for `dry_run=true`: the parameters' bytes and, with the caches, the run's."""
  return (
      f"parameters: {need.param_bytes} bytes ({cfg.weight_dtype} weights, {_weights(cfg)});"
      f" with the KV caches: {need.total_bytes} bytes"
  )


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="ascii") as f:
      return f.read()
  except (OSError, UnicodeDecodeError):
    return None


def available_memory(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
  """(bytes the process may still use, where the figure comes from), or None when nothing says.

  Args:
    environ: the environment to read `MAXTEXT_MEMORY_LIMIT_BYTES` from (default `os.environ`).

  Raises:
    ConfigError: `MAXTEXT_MEMORY_LIMIT_BYTES` is set but not a positive integer.
  """
  environ = os.environ if environ is None else environ
  text = environ.get(LIMIT_ENV, "").strip()
  if text:
    if not text.isdigit() or int(text) <= 0:
      raise ConfigError(f"environment variable {LIMIT_ENV}={text!r}: must be a positive number of bytes")
    return int(text), LIMIT_ENV
  found: list[tuple[int, str]] = []
  for limit_path, usage_path in _CGROUP_FILES:
    limit, usage = (_read(limit_path) or "").strip(), (_read(usage_path) or "").strip()
    if limit.isdigit() and int(limit) < _NO_LIMIT:
      used = int(usage) if usage.isdigit() else 0
      found.append((max(0, int(limit) - used), f"the cgroup limit {limit_path} less {used} bytes in use"))
      break
  for line in (_read(_MEMINFO) or "").splitlines():
    if line.startswith("MemAvailable:"):
      kib = line.split()[1]
      if kib.isdigit():
        found.append((int(kib) * 1024, f"MemAvailable in {_MEMINFO}"))
  return min(found) if found else None


def _gb(n: int) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _what_to_change(cfg: ml_collections.FrozenConfigDict, need: MemoryNeed, available: int) -> str:
  """The changes that would bring the run within `available` bytes: the parameters' when they are the larger part
  or fill the memory alone, the caches' when shrinking them could close the gap."""
  advice = []
  if need.param_bytes >= need.cache_bytes or need.param_bytes >= available:
    if cfg.weight_dtype == "float32":
      advice.append(f"weight_dtype=bfloat16 (parameters {_gb(need.param_bytes // 2)})")
    advice.append("a smaller model")
  room = available - need.param_bytes
  if room > 0 and need.cache_bytes > room // 2:
    advice.append(
        f"KV caches within {_gb(room)}: a smaller kv_cache_memory_bytes, num_kv_blocks, max_target_length or"
        " max_num_seqs"
    )
  return " or ".join(advice)


def check_fits(cfg: ml_collections.FrozenConfigDict, environ: Mapping[str, str] | None = None) -> MemoryNeed:
  """Refuses a run whose parameters and caches cannot fit in the available memory; warns before random weights
  of more than `RANDOM_WEIGHTS_WARNING_BYTES` when no checkpoint is configured.

  Args:
    cfg: the run's config (model keys and cache keys).
    environ: as for `available_memory`.

  Returns:
    The run's `MemoryNeed`.

  Raises:
    InsufficientMemoryError: the parameters and caches need more than the available memory (the message names
      both parts, the available figure and its source, and what to change).
    ConfigError: `MAXTEXT_MEMORY_LIMIT_BYTES` is malformed.
  """
  need = memory_need(cfg)
  available = available_memory(environ)
  if available is not None and need.total_bytes > available[0]:
    raise InsufficientMemoryError(
        f"model_name={cfg.model_name} needs {_gb(need.total_bytes)} ({_gb(need.param_bytes)} of {cfg.weight_dtype}"
        f" parameters, {_weights(cfg)}, + {_gb(need.cache_bytes)} of KV caches) but {_gb(available[0])} is"
        f" available ({available[1]}); use {_what_to_change(cfg, need, available[0])}"
    )
  if not source.names_checkpoint(cfg) and need.param_bytes > RANDOM_WEIGHTS_WARNING_BYTES:
    logger.warning(
        "model_name=%s names no checkpoint: building %s of random %s weights (give hf_model_path,"
        " gguf_model_path or load_parameters_path for real ones)",
        cfg.model_name,
        _gb(need.param_bytes),
        cfg.weight_dtype,
    )
  return need
