"""The engine's step programs: the jitted step functions over the prepared weights, one program per distinct set of
compile options (traced per shape), whole executables kept on disk (`step_programs.ProgramCache`), and the
background thread that loads them, or compiles the one-token greedy decode step, while the weights load.

`LLMEngine` (engine.py) asks `EnginePrograms` for a program and runs it; what a program is made of is
step_programs.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from maxtext.inference import step_programs
from maxtext.inference.batch import BatchInputs, build_batch, next_power_of_two, padded_num_tokens
from maxtext.inference.engine_build import EngineWeights, make_kv_cache_manager
from maxtext.inference.kv_cache_manager import KVCacheManager, max_num_reqs
from maxtext.inference.request import Request
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import Scheduler
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata

logger = logging.getLogger(__name__)

# A step's fixed inputs: the parameters (flat) and the caches, as arrays or shapes.
FixedArgs = tuple[Sequence[Any], Sequence[Any]]


def _to_device(value: Any) -> Any:
  return None if value is None else jnp.asarray(value)


def make_attention_metadata(
    batch: BatchInputs, *, on_device: bool = True
) -> AttentionMetadata | GroupedAttentionMetadata:
  """The step's metadata: one `AttentionMetadata`, or a grouped mapping when there is more than one group.

  Args:
    batch: the step's inputs.
    on_device: put every array on the device; False keeps the NumPy arrays, for a jitted call to transfer
      (its C++ dispatch moves them in one pass, cheaper than one `jnp.asarray` per array).
  """
  convert = _to_device if on_device else (lambda value: value)
  groups = [
      AttentionMetadata(**{k: v if k == "padded_num_reqs" else convert(v) for k, v in fields.items()})
      for fields in batch.metadata_fields()
  ]
  if len(groups) == 1:
    return groups[0]
  return GroupedAttentionMetadata(groups, batch.layer_names_per_group)


def metadata_positions(metadata: AttentionMetadata | GroupedAttentionMetadata) -> jax.Array:
  """The positions array the runner passes positionally (the same array as in the metadata)."""
  if isinstance(metadata, AttentionMetadata):
    return metadata.input_positions
  return metadata.groups[0].input_positions


_NO_PREVIOUS_TOKENS: dict[int, np.ndarray] = {}


def no_previous_tokens(num_rows: int) -> tuple[np.ndarray, np.int32]:
  """The previous-token inputs of a greedy step that takes none: `num_rows` zeros (the shape of its own token
  output, so every step of a bucket has one signature) and a count of 0."""
  if num_rows not in _NO_PREVIOUS_TOKENS:
    _NO_PREVIOUS_TOKENS[num_rows] = np.zeros((num_rows,), np.int32)
  return _NO_PREVIOUS_TOKENS[num_rows], np.int32(0)


def step_inputs(leaves: Sequence[Any], kv_caches: Sequence[Any], batch: BatchInputs) -> tuple[Any, ...]:
  """A step program's leading arguments for `batch`: the parameters' leaves, the caches, the token ids, the
  attention metadata (host arrays) and the positions."""
  metadata = make_attention_metadata(batch, on_device=False)
  return (leaves, kv_caches, batch.input_ids, metadata, metadata_positions(metadata))


def sampling_logits_indices(
    batch: BatchInputs, sampling_request_ids: Sequence[str], num_rows: int | None = None
) -> np.ndarray:
  """The hidden-state rows to compute logits for: each sampling request's last token, in `sampling_request_ids` order.

  Only the requests that sample this step get logits (a chunked prefill that does not finish its prompt gets
  none). The rows are padded (repeating the first row) to `num_rows`, or to a power of two when None, so the logits
  program compiles once per bucket.

  Returns:
    `[num_rows or next_power_of_two(len(sampling_request_ids))]` int32; the first `len(sampling_request_ids)` rows
    are real.

  Raises:
    ValueError: `num_rows` is below the number of sampling requests.
  """
  rows = [batch.request_ids.index(rid) for rid in sampling_request_ids]
  size = next_power_of_two(len(rows)) if num_rows is None else num_rows
  if size < len(rows):
    raise ValueError(f"num_rows={num_rows} cannot hold the logits rows of {len(rows)} sampling requests")
  indices = np.full((size,), batch.logits_indices[rows[0]], np.int32)
  indices[: len(rows)] = batch.logits_indices[rows]
  return indices


class EnginePrograms:
  """The step programs of one engine, with the runner's settings (kv_caches donated, the layer map static).

  A step compiles with the options the backend asks for its size (`compiler_options`): one jitted function per
  distinct set, traced per shape. Greedy steps without logprobs run the model and the argmax as one program
  (`step_greedy`): one dispatch per step, and only the token ids come back to the host.

  Args:
    cfg: the run's config (with its kernel backend set).
    mesh: the engine's device mesh.
    compilation_cache_dir: the folder JAX's compilation cache uses, or None.
    weights: the engine's weights (their prepared structure; their arrays when a program cache is first made).
    manager: the engine's KV-cache manager (the layer map, the caches' shapes).
    current_caches: returns the engine's caches at the time it is called.
    on_trace: called each time a step is traced.
  """

  def __init__(
      self,
      cfg: ml_collections.FrozenConfigDict,
      mesh: jax.sharding.Mesh,
      compilation_cache_dir: str | None,
      weights: EngineWeights,
      manager: KVCacheManager,
      current_caches: Callable[[], Sequence[Any]],
      on_trace: Callable[[], None],
  ):
    self.cfg, self.mesh, self.compilation_cache_dir = cfg, mesh, compilation_cache_dir
    self.weights, self.layer_map, self._current_caches = weights, manager.layer_name_to_kvcache_index, current_caches
    fns = step_programs.make_step_functions(weights.graphdef, weights.state_def, on_trace)
    self._jitted_steps = {"step": (fns.step, 5), "step_greedy": (fns.step_greedy, 8)}
    self._programs: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
    self._lock = threading.Lock()  # the background compile asks for a program too
    self._cache: step_programs.ProgramCache | bool | None = None  # False: off (`program_cache`)
    self.zero_rows = jax.jit(step_programs.zero_rows, donate_argnums=(0,))
    self.zero_rows_bucket = next_power_of_two(max_num_reqs(cfg))
    self.logits = jax.jit(fns.logits)
    self.background_compile: threading.Thread | None = None
    self._background_tokens = padded_num_tokens(1, int(cfg.max_num_batched_tokens), int(cfg.min_token_bucket))

  def start_background_compile(self, cache_shapes: Sequence[Any]) -> None:
    """Loads the step programs (or compiles the one-request greedy decode step) in a thread while the caches are
    allocated and the weights load: shapes are all it needs. Only for a checkpoint's model on one device."""
    if not (self.cfg.background_compile and not self.weights.model.is_dummy and self.mesh.size == 1):
      return
    shapes = ([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.weights.leaves], cache_shapes)
    # Not a daemon: a process that exits (or fails to load the weights) while XLA compiles must wait for it, as
    # the interpreter's shutdown would otherwise unwind the thread inside XLA's C++ and abort the process.
    self.background_compile = threading.Thread(
        target=self._compile_smallest_greedy_step, args=shapes, name="maxtext-compile", daemon=False
    )
    self.background_compile.start()

  def program(self, name: str, num_tokens: int) -> Any:
    """The jitted `name` program ("step", "step_greedy") with the compile options the backend asks for a step of
    `num_tokens` (padded) tokens; kv_caches donated, the layer map static."""
    options = self.weights.backend.compiler_options(num_tokens)
    key = (name, tuple(sorted(options.items())))
    with self._lock:
      if key not in self._programs:
        fn, layer_map_arg = self._jitted_steps[name]
        cache = self.program_cache()
        jit_args = {"donate_argnums": (1,), "static_argnums": (layer_map_arg,), "compiler_options": options or None}
        if cache is None:
          self._programs[key] = jax.jit(fn, **jit_args)
        else:
          jitted = jax.jit(step_programs.named(fn, cache.program_name(name)), **jit_args)
          self._programs[key] = step_programs.StepProgram(jitted, name, options, cache)
      return self._programs[key]

  def program_cache(self, fixed: FixedArgs | None = None) -> step_programs.ProgramCache | None:
    """The folder of whole step executables (`step_programs`), made on first use; None when it is off (no
    compilation cache of the config's own, or a mesh of several devices). `fixed`: the parameters and the caches
    (arrays or their shapes; default: the engine's)."""
    if self._cache is None:
      folder = step_programs.folder_for(self.cfg, self.compilation_cache_dir)
      if folder is None or self.mesh.size != 1:
        self._cache = False
      else:
        backend = self.weights.backend
        # The programs call the C++ kernels by name: they are registered (and their availability keyed) first.
        kernels = backend.load_kernels()
        fixed = fixed or (self.weights.leaves, self._current_caches())
        run_key = step_programs.run_key(self.cfg, backend, fixed, self.layer_map, kernels=kernels)
        self._cache = step_programs.ProgramCache(folder, run_key, list(self.mesh.devices.flat))
    return self._cache or None

  def _compile_smallest_greedy_step(self, leaves: Sequence[Any], kv_caches: Sequence[Any]) -> None:
    """Loads the step programs this run used most recently (`ProgramCache.preload`), then traces and compiles the
    greedy step of one request and the smallest token bucket (a one-token decode), unless it was among them.

    Runs in a thread while the weights load: it needs only shapes (`leaves`, `kv_caches`: the parameters' and the
    caches'), and JAX keeps the trace and the executable, so the first such step finds both. The batch comes from
    a throwaway scheduler. A failure only logs (the step then compiles when first used).
    """
    try:
      with self._lock:
        cache = self.program_cache((leaves, kv_caches))
      if cache is not None:
        cache.preload()  # the programs this run used last time (a prefill bucket among them), for the first steps
      manager = make_kv_cache_manager(self.cfg)
      scheduler = Scheduler(self.cfg, manager)
      scheduler.add_request(Request("background-compile", [0], SamplingParams(max_tokens=1, temperature=0.0)))
      out = scheduler.schedule()
      batch = build_batch(self.cfg, out, manager)
      step, indices = self.greedy_program(batch, out.sampling_request_ids)
      prev, num_prev = no_previous_tokens(indices.shape[0])
      args = (*step_inputs(leaves, kv_caches, batch), indices, prev, num_prev, self.layer_map)
      if isinstance(step, step_programs.StepProgram):
        step.prepare(*args)  # from the folder, else traced, compiled and stored
      else:
        step.lower(*args).compile()
    except Exception as e:  # pylint: disable=broad-exception-caught  # an optimisation must not break the engine
      logger.warning("compiling the decode step in the background failed (it compiles when first used): %s", e)

  def greedy_program(self, batch: BatchInputs, sampling_request_ids: Sequence[str]) -> tuple[Any, np.ndarray]:
    """The fused greedy step program for `batch`, and its logits rows.

    The rows are padded to a size fixed by the step's static shapes (its token and request buckets), so the fused
    program compiles no more often than the step alone.
    """
    num_rows = min(batch.padded_num_reqs, batch.padded_num_tokens)
    indices = sampling_logits_indices(batch, sampling_request_ids, num_rows=num_rows)
    return self.program("step_greedy", batch.padded_num_tokens), indices

  def wait_for_background_compile(self, batch: BatchInputs) -> None:
    """Before a greedy step of the background program's token bucket, waits until that program is compiled."""
    if self.background_compile is not None and batch.padded_num_tokens == self._background_tokens:
      start = time.perf_counter()
      self.background_compile.join()
      step_programs.add_compile_seconds(time.perf_counter() - start)
      self.background_compile = None
