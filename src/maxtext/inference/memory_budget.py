"""The memory a run needs, from its config alone, against the memory the process may use.

Before anything is allocated, the engine adds four figures, all from abstract shapes (nothing is built):

  - the parameters as loaded (the abstract model's shapes in `weight_dtype`) and as kept once the kernel backend has
    laid them out (`prepare_params` on the abstract model: `quantization=int8w`'s int8 panels, a tied head's int8 or
    int4 copy); a load holds the first form whole before it is laid out, so the larger of the two counts, and on top
    of it the larger of two transients: the tensors the backend re-lays, held in both layouts until the layout is
    done (a start from the weight cache copies them out of the file's mapping, the same bytes again), and the
    checkpoint's files, mapped while they are read (a GGUF file, a folder's safetensors);
  - the KV caches and recurrent states (the layout `dry_run=true` prints);
  - the activations of the largest step: `max_num_batched_tokens` (padded) rows of the residual stream, the attention
    projections and the widest MLP, and the logits of every request row (`activation_bytes`);

and compares the sum with the memory available: the environment variable `MAXTEXT_MEMORY_LIMIT_BYTES` when set, else
the smallest of what the cgroup may still use (`memory.max` less `memory.current`; cgroup v1's
`memory.limit_in_bytes` less `memory.usage_in_bytes`), what `RLIMIT_AS` leaves beside the process's address space
(`VmSize`) and the kernel's `MemAvailable`. A run that cannot fit is refused with one line naming the figures and
what to change, instead of being killed by the kernel without a word; `memory_check=false` runs it anyway. The
runtime's own memory (JAX, XLA and the compiled programs: about 0.35-0.45 GB for the tiny models) is not counted: a
run that passes can still be short of memory when the margin is thin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import resource
from collections.abc import Mapping

import jax
import ml_collections
import numpy as np
from flax import nnx

from maxtext.checkpoint import source
from maxtext.configs import ConfigError, config_to_dict
from maxtext.inference.batch import next_power_of_two
from maxtext.inference.kv_cache_manager import KVCacheManager, max_num_reqs
from maxtext.kernels import backend as kernel_backends
from maxtext.kv_cache import kv_cache_spec
from maxtext.models import abstract_model, flat_param_shapes

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
_PROC_STATUS = "/proc/self/status"
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63
_LOGITS_ITEMSIZE = 4  # the logits and their log-softmax are float32 whatever `dtype` is
_GIB = 1 << 30
_MIB = 1 << 20


class InsufficientMemoryError(ConfigError):
  """The run's parameters, caches and activations need more memory than the process may use."""


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
  """What a run's config asks for, in bytes.

  Attributes:
    load_param_bytes: the parameters in `weight_dtype`, the form a load or a random initialisation holds.
    kept_param_bytes: the parameters once the kernel backend has laid them out (what the run keeps).
    cache_bytes: the KV caches and recurrent states.
    activation_bytes: the largest step's activations (`activation_bytes`).
    relaid_param_bytes: the bytes the kernel backend re-lays (`prepare_params`' count).
    checkpoint_file_bytes: the checkpoint files a load maps (`checkpoint_file_bytes`).
  """

  load_param_bytes: int
  kept_param_bytes: int
  cache_bytes: int
  activation_bytes: int
  relaid_param_bytes: int = 0
  checkpoint_file_bytes: int = 0

  @property
  def param_bytes(self) -> int:
    """The parameters' peak: the larger of the loaded and the kept form, and the larger transient beside it (the
    re-laid tensors' second layout, or the checkpoint's mapped files)."""
    transient = max(self.relaid_param_bytes, self.checkpoint_file_bytes)
    return max(self.load_param_bytes, self.kept_param_bytes) + transient

  @property
  def total_bytes(self) -> int:
    """The parameters' peak, the caches and the activations together."""
    return self.param_bytes + self.cache_bytes + self.activation_bytes


def param_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of every parameter of the model of `cfg` in `weight_dtype`, from the abstract model (nothing is
  allocated)."""
  return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in flat_param_shapes(cfg).values())


def backend_name(cfg: ml_collections.FrozenConfigDict) -> str:
  """The kernel backend a run of `cfg` uses: `kernel_backend`, else the device's default for the mesh of the
  `ici_*_parallelism` keys (`device_default_name`)."""
  if cfg.kernel_backend:
    return cfg.kernel_backend
  devices = int(cfg.ici_data_parallelism) * int(cfg.ici_tensor_parallelism) * int(cfg.ici_expert_parallelism)
  return kernel_backends.device_default_name(None) if devices == 1 else kernel_backends.REFERENCE


def _state_bytes(model: nnx.Module) -> int:
  leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def param_figures(cfg: ml_collections.FrozenConfigDict) -> tuple[int, int, int]:
  """(bytes of the parameters in `weight_dtype`, bytes once the kernel backend of `cfg` has laid them out, bytes it
  re-laid), from one abstract model (`prepare_params` on it: shapes only)."""
  model = abstract_model(cfg)
  loaded = _state_bytes(model)
  relaid = kernel_backends.get_backend(backend_name(cfg), None, cfg).prepare_params(model)
  return loaded, _state_bytes(model), int(relaid)


def kept_param_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of the parameters once the kernel backend of `cfg` has laid them out."""
  return param_figures(cfg)[1]


def checkpoint_file_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of the checkpoint files a load maps into memory: the GGUF file (`gguf_model_path`), else the folder's
  `*.safetensors` (`hf_model_path`); 0 for an Orbax checkpoint (read into arrays), random weights or a missing
  file (the load reports that)."""
  paths = []
  if cfg["gguf_model_path"]:
    paths = [os.path.expanduser(cfg["gguf_model_path"])]
  elif cfg["hf_model_path"] and not cfg["load_parameters_path"]:
    folder = os.path.expanduser(cfg["hf_model_path"])
    with contextlib.suppress(OSError):
      paths = [os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".safetensors")]
  total = 0
  for path in paths:
    with contextlib.suppress(OSError):
      total += os.path.getsize(path)
  return total


def cache_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """Bytes of the KV caches and recurrent states the engine allocates for `cfg` (the `dry_run=true` total)."""
  manager = KVCacheManager(cfg, kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg))
  return sum(entry.nbytes for entry in manager.describe_slots())


def activation_bytes(cfg: ml_collections.FrozenConfigDict) -> int:
  """A bound on the activations of the largest step, in `dtype` (the logits in float32).

  A step of `T` tokens (`max_num_batched_tokens` padded to its power-of-two bucket) holds one layer's activations at
  a time: four `[T, emb]` arrays (the residual stream, its norm, the mixer's and the MLP's outputs), the attention
  projections `[T, (2 query heads + 2 KV heads) x head_dim]` (queries, attention output, keys, values), and three
  `[T, width]` arrays of the widest MLP (gate, up and their product; a MoE layer's width is
  `num_experts_per_tok x base_moe_mlp_dim`); then the logits of every request row (`max(max_num_seqs, 8)`) and
  their log-softmax, `[rows, vocab]` each.
  """
  tokens = next_power_of_two(int(cfg.max_num_batched_tokens))
  mlp = max(int(cfg.base_mlp_dim), int(cfg.num_experts_per_tok) * int(cfg.base_moe_mlp_dim) if cfg.num_experts else 0)
  heads = 2 * int(cfg.base_num_query_heads) + 2 * int(cfg.base_num_kv_heads)
  per_token = 4 * int(cfg.base_emb_dim) + heads * int(cfg.head_dim) + 3 * mlp
  logits = 2 * max_num_reqs(cfg) * int(cfg.vocab_size) * _LOGITS_ITEMSIZE
  return tokens * per_token * np.dtype(cfg.dtype).itemsize + logits


def memory_need(cfg: ml_collections.FrozenConfigDict) -> MemoryNeed:
  """The parameter (loaded, kept, re-laid), cache, activation and checkpoint-file bytes of `cfg`."""
  loaded, kept, relaid = param_figures(cfg)
  return MemoryNeed(loaded, kept, cache_bytes(cfg), activation_bytes(cfg), relaid, checkpoint_file_bytes(cfg))


def _weights(cfg: ml_collections.FrozenConfigDict) -> str:
  return "from the checkpoint" if source.names_checkpoint(cfg) else "random, no checkpoint"


def _kept_form(cfg: ml_collections.FrozenConfigDict) -> str:
  form = f"kernel_backend={backend_name(cfg)}"
  return f"{form}, quantization={cfg.quantization}" if cfg.quantization else form


def format_need(cfg: ml_collections.FrozenConfigDict, need: MemoryNeed) -> str:
  """One line for `dry_run=true`: the parameters' bytes as loaded, as kept and at the loading peak, the activations',
  and with the caches the run's."""
  return (
      f"parameters: {need.load_param_bytes} bytes ({cfg.weight_dtype} weights, {_weights(cfg)}), kept as"
      f" {need.kept_param_bytes} bytes ({_kept_form(cfg)}), at most {need.param_bytes} bytes while loading;"
      f" activations: {need.activation_bytes} bytes; in all, with the KV caches: {need.total_bytes} bytes"
  )


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="ascii") as f:
      return f.read()
  except (OSError, UnicodeDecodeError):
    return None


def cgroup_room(limit_text: str | None, usage_text: str | None) -> int | None:
  """What a cgroup may still use: its limit (`memory.max`, v1's `memory.limit_in_bytes`) less its use
  (`memory.current`, `memory.usage_in_bytes`; 0 when unreadable), or None without a limit ("max", v1's number near
  2**63, an unreadable file)."""
  limit, usage = (limit_text or "").strip(), (usage_text or "").strip()
  if not limit.isdigit() or int(limit) >= _NO_LIMIT:
    return None
  return max(0, int(limit) - (int(usage) if usage.isdigit() else 0))


def meminfo_available(meminfo_text: str | None) -> int | None:
  """`MemAvailable` of a /proc/meminfo text in bytes, or None when it has none."""
  for line in (meminfo_text or "").splitlines():
    fields = line.split()
    if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
      return int(fields[1]) * 1024
  return None


def address_space_room(limit: int, status_text: str | None) -> int | None:
  """What an `RLIMIT_AS` soft limit of `limit` bytes leaves beside the address space the process has (`VmSize` of a
  /proc/self/status text, 0 when it has none), or None when `limit` is `RLIM_INFINITY`."""
  if limit == resource.RLIM_INFINITY or limit < 0:
    return None
  size = 0
  for line in (status_text or "").splitlines():
    fields = line.split()
    if len(fields) >= 2 and fields[0] == "VmSize:" and fields[1].isdigit():
      size = int(fields[1]) * 1024
  return max(0, limit - size)


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
    room = cgroup_room(_read(limit_path), _read(usage_path))
    if room is not None:
      found.append((room, f"the cgroup limit {limit_path} less its use"))
      break
  room = address_space_room(resource.getrlimit(resource.RLIMIT_AS)[0], _read(_PROC_STATUS))
  if room is not None:
    found.append((room, "RLIMIT_AS less the process's VmSize"))
  available = meminfo_available(_read(_MEMINFO))
  if available is not None:
    found.append((available, f"MemAvailable in {_MEMINFO}"))
  return min(found) if found else None


def format_bytes(n: int) -> str:
  """`n` bytes in GiB (MiB below 1 GiB), two decimals."""
  return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / _MIB:.2f} MiB"


def _run_name(cfg: ml_collections.FrozenConfigDict) -> str:
  """How the message names the run: its `model_name`, else the checkpoint key that names the model."""
  if cfg.model_name != "default":
    return f"model_name={cfg.model_name}"
  for key in source.SOURCE_KEYS:
    if cfg[key]:
      return f"{key}={cfg[key]}"
  return "model_name=default"


def _what_to_change(cfg: ml_collections.FrozenConfigDict, need: MemoryNeed, available: int) -> str:
  """The changes that would bring the run within `available` bytes: the parameters' (bfloat16 for float32 weights, a
  smaller model) when they are the larger part or fill the memory alone, a KV cache sized to the room the rest
  leaves when shrinking the caches could close the gap."""
  advice = []
  fixed = need.param_bytes + need.activation_bytes
  if need.param_bytes >= need.cache_bytes or fixed >= available:
    if cfg.weight_dtype == "float32":
      values = config_to_dict(cfg)
      values.update(weight_dtype="bfloat16")
      compact = ml_collections.FrozenConfigDict(values)
      loaded, kept, relaid = param_figures(compact)
      bf16 = MemoryNeed(loaded, kept, 0, 0, relaid, need.checkpoint_file_bytes).param_bytes
      advice.append(f"weight_dtype=bfloat16 (parameters {format_bytes(bf16)})")
    advice.append("a smaller model")
  room = available - fixed
  if room > 0 and need.cache_bytes > room // 2:
    advice.append(
        f"a KV cache within the {format_bytes(room)} left (kv_cache_memory_bytes={room} or less, with a"
        " max_target_length it holds; fewer max_num_seqs for recurrent states)"
    )
  return ", ".join(advice[:-1]) + " or " + advice[-1] if len(advice) > 1 else advice[0]


def check_fits(cfg: ml_collections.FrozenConfigDict, environ: Mapping[str, str] | None = None) -> MemoryNeed:
  """Refuses a run whose parameters, caches and activations cannot fit in the available memory (unless
  `memory_check` is false); warns before random weights of more than `RANDOM_WEIGHTS_WARNING_BYTES` when no
  checkpoint is configured.

  Args:
    cfg: the run's config (model keys, cache keys, and `memory_check` when it carries the run options).
    environ: as for `available_memory`.

  Returns:
    The run's `MemoryNeed`.

  Raises:
    InsufficientMemoryError: the run needs more than the available memory (the message names each part, the
      available figure and its source, and what to change).
    ConfigError: `MAXTEXT_MEMORY_LIMIT_BYTES` is malformed.
  """
  need = memory_need(cfg)
  available = available_memory(environ) if cfg.get("memory_check", True) else None
  if available is not None and need.total_bytes > available[0]:
    raise InsufficientMemoryError(
        f"{_run_name(cfg)} needs {format_bytes(need.total_bytes)} (parameters {format_bytes(need.param_bytes)}:"
        f" {cfg.weight_dtype}, {_weights(cfg)}; KV caches {format_bytes(need.cache_bytes)}; activations"
        f" {format_bytes(need.activation_bytes)}) but {format_bytes(available[0])} is available ({available[1]});"
        f" use {_what_to_change(cfg, need, available[0])}; memory_check=false runs it anyway"
    )
  if not source.names_checkpoint(cfg) and need.load_param_bytes > RANDOM_WEIGHTS_WARNING_BYTES:
    logger.warning(
        "%s names no checkpoint: building %s of random %s weights (give hf_model_path, gguf_model_path or"
        " load_parameters_path for real ones)",
        _run_name(cfg),
        format_bytes(need.load_param_bytes),
        cfg.weight_dtype,
    )
  return need
