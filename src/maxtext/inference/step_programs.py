"""The engine's compiled step programs kept on disk whole, so a later start neither traces nor compiles them.

JAX's persistent compilation cache (`compilation_cache`) saves the compile, but a start still traces the model's
Python into a program and lowers it to find the cache key: about a second per program for a 30-layer model, the
larger part of a warm start once the weights come from the weight cache. This module keeps the executable itself
(`jax.experimental.serialize_executable`), keyed without tracing by everything that shapes the program:

  - the program's name, compile options and the shapes and dtypes of its inputs (the parameters, the caches, the
    batch arrays and the attention metadata's, in their tree structure) and its static layer map;
  - the run's config without its run options (the `CLI` and `RUNNER` keys of configs/keys.py: prompts, sampling,
    output, the engine's host-side switches), which holds the model's keys and the cache, batch and layout keys,
    and the kernel backend's name and options (`cpu_weight_panels` among them);
  - a SHA-256 of this package's sources (every `.py`, `.yml`, `.cc` and `.h`), the versions of JAX, jaxlib and
    NumPy, JAX's configuration values, `XLA_FLAGS`, and the host CPU's model and feature flags (XLA compiles for
    the CPU it runs on).

A file holds the serialized executable and its input and output trees; a file that cannot be read or loaded is a
logged miss (removed, traced and compiled again). Each run key also keeps the list of its programs, most recently
used first (`<digest>.recent`): a start loads those in a background thread (`ProgramCache.preload`) while it loads
the weights and reads the prompt, so its first steps find their executables in memory.

The programs call this package's C++ kernels by name (XLA's FFI), so the backend loads and registers them before a
program is loaded (`KernelBackend.load_kernels`). Entries are written whole (temporary file, rename), and the folder
keeps at most `MAX_BYTES` (1 GiB; least recently used programs go first). They live in `maxtext-steps/` inside the
compilation cache folder the config names (`compilation_cache_dir`), only when that is the folder JAX caches in: a
folder JAX was given from outside (`JAX_COMPILATION_CACHE_DIR`) keeps JAX's own entries only. Loading an executable
runs code from the folder: like the compilation cache, it must not be writable by anyone untrusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import threading
import time
from concurrent import futures
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import serialize_executable

from maxtext import user_cache
from maxtext.checkpoint import weight_cache

logger = logging.getLogger(__name__)

FOLDER_NAME = "maxtext-steps"
# An executable that JAX loaded from its own persistent cache serializes without the machine code of its fusions
# (running such a copy fails: "Function ... not found"), so only executables compiled in this process are kept. The
# programs this module keeps are named after their run key (`ProgramCache.program_name`), and JAX's cache key holds
# the program's name: a program whose entry here is missing (a new package version, a new model) gets a JAX cache
# key of its own too, so it is compiled, not taken from JAX's cache. A hit on JAX's cache all the same (an entry
# removed here but kept there), seen through JAX's monitoring events, is used and not kept.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# JAX's events that time the making of a program: tracing, lowering, compiling, reading its persistent cache.
_COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    }
)
_hits = threading.local()


def _count_cache_hit(event: str, **kwargs: Any) -> None:
  del kwargs
  if event == _CACHE_HIT_EVENT:
    _hits.count = getattr(_hits, "count", 0) + 1


def _add_compile_time(event: str, duration: float, **kwargs: Any) -> None:
  del kwargs
  if event in _COMPILE_EVENTS:
    _hits.compile_s = getattr(_hits, "compile_s", 0.0) + duration


@functools.cache
def _listen_for_cache_hits() -> None:
  jax.monitoring.register_event_listener(_count_cache_hit)


@functools.cache
def listen_for_compile_time() -> None:
  """Starts counting the seconds each thread spends making programs (`compile_seconds_in_this_thread`)."""
  jax.monitoring.register_event_duration_secs_listener(_add_compile_time)


def cache_hits_in_this_thread() -> int:
  """How many programs this thread has loaded from JAX's persistent cache since `StepProgram` first compiled."""
  return getattr(_hits, "count", 0)


def compile_seconds_in_this_thread() -> float:
  """Seconds this thread spent tracing, lowering and compiling programs (or reading them from JAX's persistent
  cache, or loading kept step programs) since `listen_for_compile_time` was first called."""
  return getattr(_hits, "compile_s", 0.0)


def add_compile_seconds(seconds: float) -> None:
  """Counts `seconds` of program making in this thread (`compile_seconds_in_this_thread`)."""
  _hits.compile_s = getattr(_hits, "compile_s", 0.0) + seconds


SUFFIX = ".program"
RECENT_SUFFIX = ".recent"
FORMAT_VERSION = 2
MAX_BYTES = 1 << 30  # the folder's size limit: least recently used programs are removed beyond it
# How many programs of a run a start loads ahead (`ProgramCache.preload`): a decode's first steps use a few (a prefill
# bucket, the one-request decode); a server's later buckets load when first used.
PRELOAD_LIMIT = 4


def package_digest() -> str:
  """A SHA-256 of every source of this package and of the library versions (`user_cache.sources_digest`): any
  change of the code may change a traced program."""
  return user_cache.sources_digest()


@functools.cache
def host_digest() -> str:
  """A SHA-256 of what the compiled code depends on outside the program: the CPU's model and feature flags, the
  machine, `XLA_FLAGS` and JAX's configuration values."""
  cpu = ""
  with contextlib.suppress(OSError):
    lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
  config = sorted((name, repr(value)) for name, value in jax.config.values.items())
  text = json.dumps([cpu, platform.machine(), os.environ.get("XLA_FLAGS", ""), config, jax.default_backend()])
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def signature(args: Sequence[Any]) -> str:
  """The tree structure, shapes and dtypes of a call's arguments (arrays or `jax.ShapeDtypeStruct`s)."""
  leaves, tree = jax.tree_util.tree_flatten(list(args))
  shapes = [
      (tuple(int(n) for n in getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__)))
      for leaf in leaves
  ]
  return f"{tree}|{shapes}"


class ProgramCache:
  """A folder of serialized step executables.

  Args:
    folder: where the files live (created on the first store).
    key: what every program of this run shares (`run_key`), as JSON data.
    devices: the devices the programs run on (default: JAX's first device).
  """

  def __init__(self, folder: str | os.PathLike, key: Mapping[str, Any], devices: Sequence[Any] | None = None):
    self.folder = Path(folder)
    self._prefix = json.dumps(key, sort_keys=True)
    self.digest = hashlib.sha256(self._prefix.encode("utf-8")).hexdigest()
    self._devices = list(devices) if devices is not None else jax.devices()[:1]
    self._lock = threading.Lock()
    self._preloading: dict[Path, futures.Future] = {}  # programs `preload` is reading, or has read for `load`

  def program_name(self, name: str) -> str:
    """The name a program of this run is jitted under (`name` and the run key's digest)."""
    return f"{name}_{self.digest[:16]}"

  def path_for(self, name: str, options: Mapping[str, str], call_signature: str) -> Path:
    """The file of one program: its name, compile options and call signature under this run's key."""
    text = json.dumps([FORMAT_VERSION, self._prefix, name, sorted(options.items()), call_signature])
    return self.folder / (hashlib.sha256(text.encode("utf-8")).hexdigest()[:40] + SUFFIX)

  def load(self, path: Path, in_tree: Any) -> Any | None:
    """The executable stored at `path` for a call of tree `in_tree`, or None (absent, or unusable: then removed,
    the reason logged). One that `preload` reads or has read is taken from it (waiting for it if need be)."""
    with self._lock:
      preloaded = self._preloading.pop(path, None)
    start = time.perf_counter()
    executable = preloaded.result() if preloaded is not None else self._read(path)
    add_compile_seconds(time.perf_counter() - start)
    if executable is None:
      return None
    if executable.in_tree != in_tree:
      logger.warning("step program %s was built for another call structure; compiling it again", path)
      return None
    self._remember(path)
    return executable

  def _read(self, path: Path) -> Any | None:
    try:
      with open(path, "rb") as f:
        data, in_tree, out_tree = pickle.load(f)
      os.utime(path)  # used now: the least recently used programs go first (`prune`)
      return serialize_executable.deserialize_and_load(
          data, in_tree, out_tree, backend=self._devices[0].client, execution_devices=self._devices
      )
    except FileNotFoundError:
      return None
    except Exception as e:  # pylint: disable=broad-exception-caught  # any unreadable entry is a miss, never a crash
      logger.warning("step program %s is unusable (%s: %s); compiling it again", path, type(e).__name__, e)
      with contextlib.suppress(OSError):
        path.unlink()
      return None

  def recent(self) -> list[Path]:
    """The files of this run's programs, most recently used first (none when the list is missing or unreadable)."""
    try:
      names = json.loads((self.folder / (self.digest[:40] + RECENT_SUFFIX)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
      return []
    if not isinstance(names, list):
      return []
    return [self.folder / name for name in names if isinstance(name, str) and name.endswith(SUFFIX) and "/" not in name]

  def _remember(self, path: Path) -> None:
    """Puts `path` first in this run's list of programs (`recent`); failures only log."""
    names = [p.name for p in self.recent()]
    if names[:1] == [path.name]:
      return
    names = [path.name] + [n for n in names if n != path.name][: 4 * PRELOAD_LIMIT - 1]
    try:
      weight_cache.write_atomic(self.folder / (self.digest[:40] + RECENT_SUFFIX), json.dumps(names).encode("utf-8"))
    except OSError as e:
      logger.warning("could not update the list of step programs in %s: %s", self.folder, e)

  def preload(self, limit: int = PRELOAD_LIMIT) -> int:
    """Reads the `limit` most recently used programs of this run (`recent`) in the calling thread, for `load` to
    take; returns how many were read. Meant for a background thread: loading an executable releases the GIL."""
    with self._lock:
      pending = {p: futures.Future() for p in self.recent()[:limit] if p not in self._preloading}
      self._preloading.update(pending)
    count = 0
    try:
      for path, future in pending.items():
        executable = self._read(path)
        future.set_result(executable)
        count += executable is not None
    finally:
      for future in pending.values():
        if not future.done():
          future.set_result(None)  # a failure above must not leave `load` waiting
    return count

  def store(self, path: Path, compiled: Any) -> bool:
    """Writes `compiled` (a `jax.stages.Compiled`) to `path`; returns whether it was written (failures only log)."""
    try:
      data, in_tree, out_tree = serialize_executable.serialize(compiled)
      weight_cache.write_atomic(path, pickle.dumps((data, in_tree, out_tree)))
    except Exception as e:  # pylint: disable=broad-exception-caught  # an optimisation must not break the engine
      logger.warning("could not keep the step program %s: %s", path, e)
      return False
    self._remember(path)
    self.prune()
    return True

  def prune(self, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Removes least recently used programs until the folder holds at most `max_bytes`; returns those removed."""
    found = []
    for entry in self.folder.glob("*" + SUFFIX):
      with contextlib.suppress(OSError):
        stat = entry.stat()
        found.append((stat.st_mtime, stat.st_size, entry))
    used, removed = sum(size for _, size, _ in found), []
    for _, size, entry in sorted(found):
      if used <= max_bytes:
        break
      with contextlib.suppress(OSError):
        entry.unlink()
        removed.append(entry)
        used -= size
    return removed


class StepProgram:
  """A jitted step whose executables come from a `ProgramCache` when it holds them, else are traced, compiled and
  stored there; callable like the jitted function.

  The first two arguments (the parameters and the caches) and the last (the static layer map) are the same for
  every call of an engine, so they are part of the cache's run key (`run_key`), not of each call's signature.

  Args:
    jitted: the `jax.jit` function (its last positional argument static) of a function named
      `cache.program_name(name)`.
    name: the program's name in the key ("step", "step_greedy").
    options: its compile options.
    cache: the folder's cache.
  """

  NUM_FIXED = 2

  def __init__(self, jitted: Callable[..., Any], name: str, options: Mapping[str, str], cache: ProgramCache):
    self._jitted, self._name, self._options, self._cache = jitted, name, dict(options), cache
    self._executables: dict[str, Any] = {}
    self._lock = threading.Lock()
    self.loaded = 0  # executables read from the folder
    self.compiled = 0  # executables traced and compiled here

  def prepare(self, *args: Any) -> Any:
    """The executable for a call with `args` (arrays or `jax.ShapeDtypeStruct`s, the static layer map last)."""
    key = signature(args[self.NUM_FIXED : -1])
    executable = self._executables.get(key)
    if executable is not None:
      return executable
    with self._lock:
      if key not in self._executables:
        path = self._cache.path_for(self._name, self._options, key)
        executable = self._cache.load(path, jax.tree_util.tree_structure((tuple(args[:-1]), {})))
        if executable is not None:
          self.loaded += 1
        else:
          _listen_for_cache_hits()
          before = cache_hits_in_this_thread()
          executable = self._jitted.lower(*args).compile()
          self.compiled += 1
          if cache_hits_in_this_thread() == before:
            self._cache.store(path, executable)
          else:
            logger.info("step program %s came from JAX's cache: not kept (its copy would lack code)", path.name)
        self._executables[key] = executable
      return self._executables[key]

  def __call__(self, *args: Any) -> Any:
    return self.prepare(*args)(*args[:-1])


def named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
  """`fn` under another name (the name JAX gives the program it traces)."""

  @functools.wraps(fn)
  def program(*args: Any) -> Any:
    return fn(*args)

  program.__name__ = program.__qualname__ = name
  return program


def run_key(cfg: Any, backend: Any, fixed_args: Sequence[Any], layer_map: Any, **extra: Any) -> dict[str, Any]:
  """What every step program of a run shares: the config without the run options, the backend's name and options
  (and `extra` facts about it), the parameters' and caches' signature (`fixed_args`), the static layer map, this
  package's and the host's digests."""
  # pylint: disable=import-outside-toplevel  # the run options' and backends' modules import the model code
  from maxtext.checkpoint.weight_cache import backend_fingerprint
  from maxtext.configs import keys as config_keys

  values = cfg.as_configdict().to_dict() if hasattr(cfg, "as_configdict") else dict(cfg)
  # The run options steer the CLI and the engine's host side; the one that changes a program's operands
  # (`cpu_weight_panels`) is the backend's option, in its fingerprint.
  keys = {k: v for k, v in sorted(values.items()) if k not in config_keys.RUN_OPTION_KEYS}
  return {
      "config": json.loads(json.dumps(keys, default=repr)),
      "backend": backend_fingerprint(backend),
      "backend_state": {k: repr(v) for k, v in sorted(extra.items())},
      "fixed": hashlib.sha256((signature(fixed_args) + "|" + repr(layer_map)).encode("utf-8")).hexdigest(),
      "package": package_digest(),
      "host": host_digest(),
  }


def folder_for(cfg: Any, jax_folder: str | None) -> Path | None:
  """`maxtext-steps/` in the config's `compilation_cache_dir` when that is JAX's folder (`jax_folder`), else None
  (caching off, or a folder JAX was given from outside)."""
  if not jax_folder or not cfg.compilation_cache_dir:
    return None
  own = os.path.abspath(os.path.expanduser(cfg.compilation_cache_dir))
  if os.path.abspath(jax_folder) != own:
    return None
  return Path(own) / FOLDER_NAME


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The functions the engine jits, over the parameters as a flat list of leaves (`jax.tree_util.tree_flatten` of
  the model's state: a list goes through JAX's C++ dispatch, an nnx State is flattened in Python on every call).

  Attributes:
    step: (leaves, kv_caches, input_ids, attention_metadata, input_positions, layer_map) -> (kv_caches, hidden):
      the runner's call of the model (`CausalLM.__call__`); `layer_map` (argument 5) is static.
    step_greedy: `step` then the greedy pick of each request's last hidden state, (leaves, kv_caches, input_ids,
      attention_metadata, input_positions, logits_indices, prev_tokens, num_prev, layer_map) -> (kv_caches, token
      ids, finite flags); the first `num_prev` input tokens are taken from `prev_tokens`, the previous step's
      token output still on the device (a decode step dispatched before they reached the host); `layer_map`
      (argument 8) is static.
    logits: (leaves, hidden, logits_indices) -> the logits of the rows `logits_indices` of `hidden`.
  """

  step: Callable[..., Any]
  step_greedy: Callable[..., Any]
  logits: Callable[..., Any]


def make_step_functions(graphdef: Any, state_def: Any, on_trace: Callable[[], None]) -> StepFunctions:
  """The step functions of the model whose structure is `graphdef` and whose flat state has the tree `state_def`;
  `on_trace` runs each time `step` is traced (once per compilation)."""

  def merged(leaves):
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, leaves))

  def step(leaves, kv_caches, input_ids, attention_metadata, input_positions, layer_map):
    on_trace()  # Python side effect: runs once per trace
    model = merged(leaves)
    kv_caches, hidden, _, _ = model(
        kv_caches, input_ids, attention_metadata, None, input_positions, layer_map, None, None, True, True
    )
    return kv_caches, hidden

  def logits(leaves, hidden, logits_indices):
    return merged(leaves).compute_logits(hidden[logits_indices])

  def step_greedy(
      leaves, kv_caches, input_ids, attention_metadata, input_positions, logits_indices, prev_tokens, num_prev, layer_map
  ):
    rows = jnp.arange(input_ids.shape[0])
    fed_back = prev_tokens[jnp.minimum(rows, prev_tokens.shape[0] - 1)]
    input_ids = jnp.where(rows < num_prev, fed_back, input_ids)
    kv_caches, hidden = step(leaves, kv_caches, input_ids, attention_metadata, input_positions, layer_map)
    return (kv_caches, *merged(leaves).greedy_token_ids(hidden[logits_indices]))

  return StepFunctions(step=step, step_greedy=step_greedy, logits=logits)


def zero_rows(states: Sequence[jax.Array], rows: jax.Array) -> tuple[jax.Array, ...]:
  """`states` with the rows `rows` set to zero (rows past the end are dropped: the padding of a fixed bucket)."""
  return tuple(state.at[rows].set(0, mode="drop") for state in states)
