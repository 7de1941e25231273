"""The reference runner's step loop: schedule, allocate, build metadata, run the jitted model, sample.

One step, as tpu-inference does it (docs/architecture.md, "One step"): the scheduler picks requests and token
counts; the KV-cache manager allocates each KV-cache group's blocks from one pool, and recurrent state slots; the
batch builder makes one `AttentionMetadata` per group; `jit(model.__call__)` runs with the caches donated and the
layer map static; `compute_logits` runs on each request's last hidden state; the sampler picks tokens; the scheduler
appends them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from maxtext.checkpoint import weight_cache
from maxtext.inference import compilation_cache, memory_budget, step_programs
from maxtext.inference.batch import BatchInputs, build_batch, next_power_of_two, padded_num_tokens
from maxtext.inference.kv_cache_manager import KVCacheManager, max_num_reqs
from maxtext.inference.prompts import num_generatable_tokens
from maxtext.inference.request import FINISH_STOP, Request, RequestStatus
from maxtext.inference.sampler import Sampler, TokenHistory, TokenLogprobs
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from maxtext.kv_cache import kv_cache_spec
from maxtext.causal_lm import CausalLM
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata
from maxtext.kernels.backend import device_default_name
from maxtext.models import sharding

logger = logging.getLogger(__name__)
# What a start is doing (loading, compiling), for a command line to show while it waits (`maxtext-decode` on a
# terminal); nothing is printed unless a program turns it on.
status = logging.getLogger("maxtext.status")
COMPILE_NOTICE_S = 1.0
COMPILE_NOTICE = (
    "compiling the step programs (the first run of a model takes a while; later runs load them from the compilation"
    " cache)"
)


@dataclasses.dataclass
class EngineStats:
  """Counters of one engine's life (reported by the CLI's JSON output)."""

  steps: int = 0
  step_traces: int = 0
  prompt_tokens: int = 0
  generated_tokens: int = 0
  scheduled_tokens: int = 0
  preemptions: int = 0
  aborted_requests: int = 0
  overlapped_steps: int = 0
  wall_time_s: float = 0.0
  prefix_cache_queries: int = 0
  prefix_cache_hits: int = 0
  peak_running_requests: int = 0
  peak_kv_blocks: int = 0
  cached_tokens_per_request: dict[str, int] = dataclasses.field(default_factory=dict)

  def as_dict(self) -> dict[str, Any]:
    """Plain dict, with generated tokens per second of wall time and the prefix-cache hit rate.

    `overlapped_steps` counts the greedy decode steps dispatched before the previous step's tokens reached the
    host (`overlap_decode_steps`). `prefix_cache_queries` / `prefix_cache_hits` count tokens looked up / found in
    the prefix cache at every admission (re-admissions after a preemption too); `cached_tokens_per_request` maps
    each finished request to the prompt tokens it skipped when first admitted. All are 0 / empty with
    `enable_prefix_caching=false`. `peak_running_requests` is the most requests a step ran together;
    `peak_kv_blocks` the most blocks of the one KV-cache pool in use at once (of `num_kv_blocks - 1` usable).
    """
    out = dataclasses.asdict(self)
    out["generated_tokens_per_s"] = self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
    queries = self.prefix_cache_queries
    out["prefix_cache_hit_rate"] = self.prefix_cache_hits / queries if queries else 0.0
    return out


@dataclasses.dataclass
class FinishedRequest:
  """A finished request's tokens, logprobs and finish reason."""

  request_id: str
  prompt_token_ids: tuple[int, ...]
  output_token_ids: tuple[int, ...]
  logprobs: tuple[TokenLogprobs, ...] | None
  finish_reason: str
  num_cached_tokens: int = 0
  stop_reason: int | str | None = None


@dataclasses.dataclass(frozen=True)
class _DispatchedStep:
  """A dispatched greedy step: its plan and its token ids and finite flags on the device.

  `rows` are the output rows of the plan's sampling requests when some of the dispatched requests were dropped
  (finished or aborted meanwhile), None when they are rows 0, 1, ...
  """

  out: SchedulerOutput
  token_ids: jax.Array
  finite: jax.Array
  rows: tuple[int, ...] | None


_NO_PREVIOUS_TOKENS: dict[int, np.ndarray] = {}


def _no_previous_tokens(num_rows: int) -> tuple[np.ndarray, np.int32]:
  """The previous-token inputs of a greedy step that takes none: `num_rows` zeros (the shape of its own token
  output, so every step of a bucket has one signature) and a count of 0."""
  if num_rows not in _NO_PREVIOUS_TOKENS:
    _NO_PREVIOUS_TOKENS[num_rows] = np.zeros((num_rows,), np.int32)
  return _NO_PREVIOUS_TOKENS[num_rows], np.int32(0)


def _step_inputs(leaves: Sequence[Any], kv_caches: Sequence[Any], batch: BatchInputs) -> tuple[Any, ...]:
  """A step program's leading arguments for `batch`: the parameters' leaves, the caches, the token ids, the
  attention metadata (host arrays) and the positions."""
  metadata = make_attention_metadata(batch, on_device=False)
  return (leaves, kv_caches, batch.input_ids, metadata, metadata_positions(metadata))


def _decode_plan(
    scheduled: Sequence[ScheduledRequest], num_computed_tokens: dict[str, int], sampling_request_ids: Sequence[str]
) -> SchedulerOutput:
  """A plan of decodes only, made by the engine (a step ahead, or one without finished requests): none preempted,
  no state slot to zero."""
  return SchedulerOutput(
      scheduled=tuple(scheduled),
      num_computed_tokens=num_computed_tokens,
      sampling_request_ids=tuple(sampling_request_ids),
      preempted_request_ids=(),
      slots_to_zero=(),
  )


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


def make_kv_cache_manager(cfg: ml_collections.FrozenConfigDict) -> KVCacheManager:
  """The KV-cache manager for the caches the model of `cfg` asks for (its per-layer specs and KV sharing)."""
  return KVCacheManager(cfg, kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg))


def _with_default_kernel_backend(
    cfg: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh
) -> ml_collections.FrozenConfigDict:
  """`cfg` with `kernel_backend` set: the device's default (`cpu` on one CPU device, else `reference`) when empty."""
  if cfg.kernel_backend:
    return cfg
  return ml_collections.FrozenConfigDict(dict(cfg.as_configdict().to_dict(), kernel_backend=device_default_name(mesh)))


class LLMEngine:
  """Runs requests to completion with continuous batching over the adapter, like tpu-inference's runner.

  The device mesh is `ici_data_parallelism x ici_tensor_parallelism x ici_expert_parallelism`; parameters and
  caches are sharded on it as the runner shards them. Compiled step programs are kept in the config's
  `compilation_cache_dir` for later runs (`compilation_cache.configure`).

  Args:
    cfg: the run's config. The model is built from its model keys alone (`CausalLM.from_config`); the
      engine itself also reads the run options it owns (`run_options.RUNNER_KEYS`, and `seed`).
    eos_token_id: the token that finishes a request, or None.

  Raises:
    ValueError: the mesh asks for more devices than JAX has.
    ConfigError: `compilation_cache_dir` is not a folder that can be created and written.
    InsufficientMemoryError: on CPU, the parameters, caches and activations need more memory than the process
      may use (`memory_budget.check_fits`, unless `memory_check` is false; nothing is allocated).
  """

  def __init__(self, cfg: ml_collections.FrozenConfigDict, *, eos_token_id: int | None = None):
    self.compilation_cache_dir = compilation_cache.configure(cfg.compilation_cache_dir)
    self.mesh = sharding.make_mesh(cfg)
    self.cfg = cfg = _with_default_kernel_backend(cfg, self.mesh)
    # Host memory only: on a CPU mesh the parameters and caches live in this process's memory; a TPU's are not.
    self.memory_need = memory_budget.check_fits(cfg) if all(d.platform == "cpu" for d in self.mesh.devices.flat) else None
    rng_key = jax.random.key(cfg.init_seed)
    self.model = CausalLM.from_config(cfg, rng_key, self.mesh)  # the model's keys only
    self.manager = make_kv_cache_manager(cfg)
    self.layer_map = self.manager.layer_name_to_kvcache_index
    self.recurrent_slots = self.manager.recurrent_slot_indices
    self.scheduler = Scheduler(cfg, self.manager, eos_token_id=eos_token_id)
    self.sampler = Sampler(cfg.seed, eos_token_id=eos_token_id)
    self.stats = EngineStats()
    self._logprobs: dict[str, list[TokenLogprobs]] = {}
    self._aborted: list[FinishedRequest] = []
    # request id -> token sampled for it by the last `step` (read by streaming callers).
    self.last_sampled: dict[str, int] = {}
    self._next_id = 0
    self.backend = self.model.backend
    graphdef, state = self._prepared_structure()
    # The jitted calls take the parameters as a flat list: flattening the nnx State (its Variables) in Python on
    # every call costs milliseconds per step, a list of arrays goes through the C++ dispatch path.
    self._state_leaves, state_def = jax.tree_util.tree_flatten(state)
    self._init_step_programs(step_programs.make_step_functions(graphdef, state_def, self._count_trace))
    self._start_background_compile()
    self.kv_caches = self.model.shard_kv_caches(self.manager.allocate_caches())
    self._zero_slots([])  # compiles the zeroing program now (no row is written), not in the first request's path
    self.weights_from_cache = False
    if not self.model.is_dummy:
      self._load_prepared_weights(rng_key, graphdef, state_def)
    else:
      self.state = state
    # The backend's work on the weights' memory (`place_params`; the cpu backend's 2 MiB pages: a decode step reads
    # every weight) runs in a thread started when the first step has run: running it while the first programs
    # compile (the background decode step, the first prefill) would take a core from those compiles and delay the
    # first call. Steps run meanwhile, a little slower until it is done. `placed_bytes` is None until then.
    self.placed_bytes: int | None = None
    self._placing: threading.Thread | None = None
    self._placing_copies: threading.Thread | None = None  # places the copies of cached weights (a daemon)
    self._placing_pending = True
    self._copied_leaves: list[Any] | None = None  # cached weights copied by the placing thread, not yet adopted
    self._state_def = state_def

  def _count_trace(self) -> None:
    self.stats.step_traces += 1

  def _prepared_structure(self) -> tuple[Any, Any]:
    """The model's structure (graphdef, state) in the backend's layout (`prepare_params`), which the step programs
    are built for; sets `prepared_bytes` (the bytes re-laid, 0 until the weights load).

    A model with random weights is laid out now. A checkpoint's model is still abstract: its structure once
    prepared comes from a copy, and loading fills the model in the checkpoint's layout (checked against it later).
    """
    self.prepared_bytes = self.backend.prepare_params(self.model) if self.model.is_dummy else 0
    graphdef, state = nnx.split(self.model)
    if not self.model.is_dummy:
      structure = nnx.merge(graphdef, state, copy=True)
      self.backend.prepare_params(structure)
      graphdef, state = nnx.split(structure)
    return graphdef, state

  def _init_step_programs(self, fns: step_programs.StepFunctions) -> None:
    """The step programs' bookkeeping: the runner's settings (kv_caches donated, the layer map static); a step
    compiles with the options the backend asks for its size (`compiler_options`): one jitted function per distinct
    set, traced per shape. Greedy steps without logprobs run the model and the argmax as one program
    (`step_greedy`): one dispatch per step, and only the token ids come back to the host."""
    self._jitted_steps = {"step": (fns.step, 5), "step_greedy": (fns.step_greedy, 8)}
    self._programs: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
    self._programs_lock = threading.Lock()  # the background compile asks for a program too
    self._program_cache: step_programs.ProgramCache | bool | None = None  # False: off (`_step_program_cache`)
    self._zero_rows = jax.jit(step_programs.zero_rows, donate_argnums=(0,))
    self._zero_rows_bucket = next_power_of_two(max_num_reqs(self.cfg))
    self._logits = jax.jit(fns.logits)
    # A greedy decode step dispatched before the previous step's tokens reached the host, with its plan.
    self._ahead: _DispatchedStep | None = None
    self.overlap_decode_steps = bool(self.cfg.overlap_decode_steps)

  def _start_background_compile(self) -> None:
    """Loads the step programs (or compiles the one-request greedy decode step) in a thread while the caches are
    allocated and the weights load: shapes are all it needs. Only for a checkpoint's model on one device."""
    cfg = self.cfg
    self._background_compile: threading.Thread | None = None
    self._background_tokens = padded_num_tokens(1, int(cfg.max_num_batched_tokens), int(cfg.min_token_bucket))
    if not (cfg.background_compile and not self.model.is_dummy and self.mesh.size == 1):
      return
    shapes = (
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self._state_leaves],
        self.manager.cache_shapes(),
    )
    # Not a daemon: a process that exits (or fails to load the weights) while XLA compiles must wait for it, as
    # the interpreter's shutdown would otherwise unwind the thread inside XLA's C++ and abort the process.
    self._background_compile = threading.Thread(
        target=self._compile_smallest_greedy_step, args=shapes, name="maxtext-compile", daemon=False
    )
    self._background_compile.start()

  def _load_prepared_weights(self, rng_key: jax.Array, graphdef: Any, state_def: Any) -> None:
    """Fills the model with its prepared parameters: from the weight cache when it holds them (`weight_cache`),
    else from the checkpoint (loaded, then laid out by the backend), which is then stored there for the next start.

    Raises:
      RuntimeError: the loaded model's structure is not the one the step programs were built for.
    """
    entry = None
    if not self.model.is_sharded:
      entry = weight_cache.run_entry(self.cfg, self.backend, str(state_def), self._state_leaves)
    cached = entry[0].load(entry[1]) if entry is not None else None
    if cached is not None:
      status.info("loading the prepared weights from %s", entry[0].folder)
      # Read-only NumPy arrays over the entry's file mapping: JAX's CPU client uses their memory without a copy.
      self._state_leaves = [jax.device_put(leaf) for leaf in cached.leaves]
      self.state = jax.tree_util.tree_unflatten(state_def, self._state_leaves)
      self.model = nnx.merge(graphdef, self.state)
      self.prepared_bytes = int(cached.extra.get("prepared_bytes", 0))
      self.weights_from_cache = True
      return
    status.info("loading and converting the weights (kept for the next start)" if entry else "loading the weights")
    self.model.load_weights(rng_key)
    self.prepared_bytes = self.backend.prepare_params(self.model)
    loaded_graphdef, self.state = nnx.split(self.model)
    self._state_leaves, loaded_def = jax.tree_util.tree_flatten(self.state)
    if (loaded_graphdef, loaded_def) != (graphdef, state_def):
      raise RuntimeError("loading the weights changed the model's structure; the step programs were built for it")
    if entry is not None:
      entry[0].store(entry[1], self._state_leaves, {"prepared_bytes": int(self.prepared_bytes)})

  def _start_placing_params(self) -> None:
    """Starts the backend's work on the weights' memory in a thread, once (none when the backend has none)."""
    if not self._placing_pending:
      return
    self._placing_pending = False
    work = self.backend.place_params(self._state_leaves)
    if work is None:
      return
    # Placing alone is system calls, which a process may exit during. Copying cached weights calls into XLA, where
    # the interpreter's shutdown would unwind the thread inside C++ and abort the process: the exit waits for it.
    self._placing = threading.Thread(
        target=self._place_params,
        args=(None if self.weights_from_cache else work,),
        name="maxtext-place-params",
        daemon=not self.weights_from_cache,
    )
    self._placing.start()

  def _place_params(self, work: Callable[[], int] | None) -> None:
    """Runs the backend's `work` on the weights' memory; sets `placed_bytes`. Failures only log.

    Without `work`, the weights are views of the weight cache's file mapping, pages the backend cannot move: they
    are first copied into memory of this process (XLA calls: this thread is not a daemon, and stops copying once
    the main thread has ended, so a short run's exit does not wait for copies nobody will read), adopted by the
    next step (`_adopt_copied_weights`), and placed by a daemon thread (system calls only).
    """
    start = time.perf_counter()
    try:
      if work is None:
        copies = []
        for leaf in self._state_leaves:
          if not threading.main_thread().is_alive():
            return
          copies.append(jax.device_put(np.array(leaf)))
        work = self.backend.place_params(copies)
        self._copied_leaves = copies
        if work is not None:
          self._placing_copies = threading.Thread(
              target=self._place_params, args=(work,), name="maxtext-place-copies", daemon=True
          )
          self._placing_copies.start()
          return
      self.placed_bytes = work() if work is not None else 0
    except Exception as e:  # pylint: disable=broad-exception-caught  # an optimisation must not break the engine
      logger.warning("kernel_backend=%s: placing the weights failed (they stay where they are): %s", self.backend.name, e)
      self.placed_bytes = 0
      return
    logger.info(
        "kernel_backend=%s placed %.1f MB of weights (%.2f s)",
        self.backend.name,
        self.placed_bytes / 1e6,
        time.perf_counter() - start,
    )

  def _adopt_copied_weights(self) -> None:
    """Steps from now on read the placing thread's copies of cached weights (equal arrays; the file's mapping goes
    once nothing holds its views)."""
    leaves, self._copied_leaves = self._copied_leaves, None
    if leaves is not None:
      self._state_leaves = leaves
      self.state = jax.tree_util.tree_unflatten(self._state_def, leaves)
      self.model = nnx.merge(nnx.graphdef(self.model), self.state)

  def _program(self, name: str, num_tokens: int) -> Any:
    """The jitted `name` program ("step", "step_greedy") with the compile options the backend asks for a step of
    `num_tokens` (padded) tokens; kv_caches donated, the layer map static."""
    options = self.backend.compiler_options(num_tokens)
    key = (name, tuple(sorted(options.items())))
    with self._programs_lock:
      if key not in self._programs:
        fn, layer_map_arg = self._jitted_steps[name]
        cache = self._step_program_cache()
        if cache is None:
          self._programs[key] = jax.jit(
              fn, donate_argnums=(1,), static_argnums=(layer_map_arg,), compiler_options=options or None
          )
        else:
          jitted = jax.jit(
              step_programs.named(fn, cache.program_name(name)),
              donate_argnums=(1,),
              static_argnums=(layer_map_arg,),
              compiler_options=options or None,
          )
          self._programs[key] = step_programs.StepProgram(jitted, name, options, cache)
      return self._programs[key]

  def _step_program_cache(self, fixed: tuple[Any, Any] | None = None) -> step_programs.ProgramCache | None:
    """The folder of whole step executables (`step_programs`), made on first use; None when it is off (no
    compilation cache of the config's own, or a mesh of several devices). `fixed`: the parameters and the caches
    (arrays or their shapes; default: the engine's)."""
    if self._program_cache is None:
      folder = step_programs.folder_for(self.cfg, self.compilation_cache_dir)
      if folder is None or self.mesh.size != 1:
        self._program_cache = False
      else:
        # The programs call the C++ kernels by name: they are registered (and their availability keyed) first.
        kernels = self.backend.load_kernels()
        fixed = fixed or (self._state_leaves, self.kv_caches)
        run_key = step_programs.run_key(self.cfg, self.backend, fixed, self.layer_map, kernels=kernels)
        self._program_cache = step_programs.ProgramCache(folder, run_key, list(self.mesh.devices.flat))
    return self._program_cache or None

  def _compile_smallest_greedy_step(self, leaves: Sequence[Any], kv_caches: Sequence[Any]) -> None:
    """Loads the step programs this run used most recently (`ProgramCache.preload`), then traces and compiles the
    greedy step of one request and the smallest token bucket (a one-token decode), unless it was among them.

    Runs in a thread while the weights load: it needs only shapes (`leaves`, `kv_caches`: the parameters' and the
    caches'), and JAX keeps the trace and the executable, so the first such step finds both. The batch comes from
    a throwaway scheduler. A failure only logs (the step then compiles when first used).
    """
    try:
      with self._programs_lock:
        cache = self._step_program_cache((leaves, kv_caches))
      if cache is not None:
        cache.preload()  # the programs this run used last time (a prefill bucket among them), for the first steps
      manager = make_kv_cache_manager(self.cfg)
      scheduler = Scheduler(self.cfg, manager)
      scheduler.add_request(Request("background-compile", [0], SamplingParams(max_tokens=1, temperature=0.0)))
      out = scheduler.schedule()
      batch = build_batch(self.cfg, out, manager)
      step, indices = self._greedy_program(batch, out.sampling_request_ids)
      prev, num_prev = _no_previous_tokens(indices.shape[0])
      args = (*_step_inputs(leaves, kv_caches, batch), indices, prev, num_prev, self.layer_map)
      if isinstance(step, step_programs.StepProgram):
        step.prepare(*args)  # from the folder, else traced, compiled and stored
      else:
        step.lower(*args).compile()
    except Exception as e:  # pylint: disable=broad-exception-caught  # an optimisation must not break the engine
      logger.warning("compiling the decode step in the background failed (it compiles when first used): %s", e)

  def _greedy_program(self, batch: BatchInputs, sampling_request_ids: Sequence[str]) -> tuple[Any, np.ndarray]:
    """The fused greedy step program for `batch`, and its logits rows.

    The rows are padded to a size fixed by the step's static shapes (its token and request buckets), so the fused
    program compiles no more often than the step alone.
    """
    num_rows = min(batch.padded_num_reqs, batch.padded_num_tokens)
    indices = sampling_logits_indices(batch, sampling_request_ids, num_rows=num_rows)
    return self._program("step_greedy", batch.padded_num_tokens), indices

  def _wait_for_background_compile(self, batch: BatchInputs) -> None:
    """Before a greedy step of the background program's token bucket, waits until that program is compiled."""
    if self._background_compile is not None and batch.padded_num_tokens == self._background_tokens:
      self._background_compile.join()
      self._background_compile = None

  def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
    """Queues a request; returns its id.

    Raises:
      TypeError, ValueError: the scheduler rejects the request (see `Scheduler.check_request`).
    """
    rid = request_id if request_id is not None else str(self._next_id)
    self._next_id += 1
    return self._queue(Request(rid, list(prompt_token_ids), params))

  def add_requests(self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[str]:
    """Queues several requests, all or none: every one is checked before any is queued.

    Args:
      prompts: (prompt token ids, sampling params) per request.

    Returns:
      The request ids, in the order of `prompts`.

    Raises:
      TypeError, ValueError: the scheduler rejects one of the requests; then none is queued.
    """
    requests = [Request(str(self._next_id + i), list(ids), params) for i, (ids, params) in enumerate(prompts)]
    for request in requests:
      self.scheduler.check_request(request)
    self._next_id += len(requests)
    return [self._queue(request) for request in requests]

  def _queue(self, request: Request) -> str:
    self.scheduler.add_request(request)
    if request.sampling_params.logprobs is not None:
      self._logprobs[request.request_id] = []
    self.stats.prompt_tokens += request.num_prompt_tokens
    return request.request_id

  def abort_request(self, request_id: str) -> None:
    """Stops a waiting or running request now; its blocks and state slot return to their pools at once.

    The other requests are not touched, so their tokens are what they would have been without it. The aborted
    request is reported by the next `step()` call with finish reason "abort" and the tokens it had generated.

    Raises:
      ValueError: no unfinished request has this id.
    """
    request = self.scheduler.abort_request(request_id)
    self.stats.aborted_requests += 1
    self._aborted.append(self._finished(request))

  def finish_request(self, request_id: str, stop_reason: str) -> None:
    """Finishes a running or waiting request now with reason "stop": its caller found the stop string
    `stop_reason` in its text. Its blocks and state slot return at once; the next `step()` reports it.

    Raises:
      ValueError: no unfinished request has this id.
    """
    request = self.scheduler.abort_request(request_id, FINISH_STOP)
    request.stop_reason = stop_reason
    self._aborted.append(self._finished(request))

  def _finished(self, r: Request) -> FinishedRequest:
    self.stats.cached_tokens_per_request[r.request_id] = r.num_cached_tokens
    return FinishedRequest(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.prompt_token_ids),
        output_token_ids=tuple(r.output_token_ids),
        logprobs=tuple(self._logprobs.pop(r.request_id)) if r.request_id in self._logprobs else None,
        finish_reason=r.finish_reason,
        num_cached_tokens=r.num_cached_tokens,
        stop_reason=r.stop_reason,
    )

  def _zero_slots(self, slots: Sequence[int]) -> None:
    """Writes zeros into the given rows of every recurrent state, in place (one jitted update per state cache).

    The row list is padded with an out-of-range row, which the update drops, to at least the request-row count:
    one program serves every step that zeroes up to that many slots, and the engine compiles it when it starts
    (run eagerly, the first reuse of a slot would compile in a request's path, and every later zeroing would
    dispatch one op per state array).
    """
    for s in self.recurrent_slots:
      states = self.kv_caches[s]
      index = np.full((max(self._zero_rows_bucket, next_power_of_two(len(slots))),), states[0].shape[0], np.int32)
      index[: len(slots)] = slots
      self.kv_caches[s] = self._zero_rows(states, index)

  def step(self) -> list[FinishedRequest]:
    """Runs one model step; returns the requests that finished in it (first those aborted since the last step).

    The tokens it sampled are in `last_sampled` (request id -> token id) until the next step. With
    `overlap_decode_steps`, a greedy decode step may dispatch the next decode step before its own tokens reach the
    host (`_plan_ahead`); the next call then starts from that step. While the engine's first step takes longer
    than `COMPILE_NOTICE_S` (it compiles its programs, or traces them when they come from the compilation cache),
    a `maxtext.status` record says so.
    """
    if self.stats.steps:
      return self._step()
    notice = threading.Timer(COMPILE_NOTICE_S, status.info, args=(COMPILE_NOTICE,))
    notice.daemon = True
    notice.start()
    try:
      return self._step()
    finally:
      notice.cancel()

  def _step(self) -> list[FinishedRequest]:
    start = time.perf_counter()
    aborted, self._aborted = self._aborted, []
    self.last_sampled = {}
    self._adopt_copied_weights()
    pending = self._take_ahead()
    sampled: dict[str, int] = {}
    if pending is None:
      out = self.scheduler.schedule()
      self.stats.preemptions += len(out.preempted_request_ids)
      if out.slots_to_zero:
        self._zero_slots(out.slots_to_zero)
      if out.is_empty:
        return aborted
      requests = {e.request.request_id: e.request for e in out.scheduled}
      params = [requests[rid].sampling_params for rid in out.sampling_request_ids]
      if params and all(p.plain_argmax for p in params):
        pending = _DispatchedStep(out, *self._dispatch_greedy(out, build_batch(self.cfg, out, self.manager)), rows=None)
      else:
        sampled = self._run_and_sample(out, requests, params)
    if pending is not None:
      out = pending.out
      try:
        ahead = self._plan_ahead(pending)
        if ahead is not None:
          batch = build_batch(self.cfg, ahead, self.manager, one_step_ahead=True)
          self._ahead = _DispatchedStep(
              ahead, *self._dispatch_greedy(ahead, batch, prev_tokens=pending.token_ids), rows=None
          )
          self.stats.overlapped_steps += 1
        token_ids, finite = np.asarray(pending.token_ids), np.asarray(pending.finite)
        rows = pending.rows if pending.rows is not None else range(len(out.sampling_request_ids))
        check_finite_rows(finite[list(rows)])
      except BaseException:
        self._ahead = None  # its plan rests on this step's tokens
        raise
      for rid, row in zip(out.sampling_request_ids, rows):
        sampled[rid] = int(token_ids[row])
    self.last_sampled = sampled
    self._start_placing_params()  # after the first step: its programs are compiled
    finished = self.scheduler.update_from_output(out, sampled)
    self.stats.steps += 1
    self.stats.scheduled_tokens += out.num_scheduled_tokens
    self.stats.generated_tokens += len(sampled)
    self.stats.prefix_cache_queries = self.scheduler.prefix_cache_queries
    self.stats.prefix_cache_hits = self.scheduler.prefix_cache_hits
    self.stats.peak_running_requests = max(self.stats.peak_running_requests, len(out.scheduled))
    self.stats.peak_kv_blocks = self.manager.peak_used_blocks
    self.stats.wall_time_s += time.perf_counter() - start
    return aborted + [self._finished(r) for r in finished]

  def _dispatch_greedy(
      self, out: SchedulerOutput, batch: BatchInputs, prev_tokens: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """Dispatches the fused greedy step of `batch` (the plan `out`); returns its token ids and finite flags, on the
    device (the caches are replaced by the step's at once).

    With `prev_tokens` (the previous step's token ids, on the device), the batch's decode rows take their input
    tokens from it (a plan one step ahead: `_plan_ahead`).
    """
    step_greedy, indices = self._greedy_program(batch, out.sampling_request_ids)
    if prev_tokens is None:
      prev_tokens, num_prev = _no_previous_tokens(indices.shape[0])
    else:
      num_prev = np.int32(batch.num_decodes)
    self._wait_for_background_compile(batch)  # never compile the same program twice at once
    inputs = _step_inputs(self._state_leaves, self.kv_caches, batch)
    self.kv_caches, token_ids, finite = step_greedy(*inputs, indices, prev_tokens, num_prev, self.layer_map)
    return token_ids, finite

  def _run_and_sample(
      self, out: SchedulerOutput, requests: dict[str, Request], params: list[SamplingParams]
  ) -> dict[str, int]:
    """Runs the step of `out`, then samples on the host (any sampling parameters, logprobs); returns the tokens."""
    batch = build_batch(self.cfg, out, self.manager)
    inputs = _step_inputs(self._state_leaves, self.kv_caches, batch)
    self.kv_caches, hidden = self._program("step", batch.padded_num_tokens)(*inputs, self.layer_map)
    sampled: dict[str, int] = {}
    if params:
      indices = sampling_logits_indices(batch, out.sampling_request_ids)
      logits = np.asarray(self._logits(self._state_leaves, hidden, indices))[: len(params)]
      rows = [requests[rid] for rid in out.sampling_request_ids]
      steps = [len(r.output_token_ids) for r in rows]
      histories = [
          TokenHistory(r.prompt_token_ids, r.output_token_ids) if r.sampling_params.has_penalties else None for r in rows
      ]
      result = self.sampler.sample(logits, params, steps, histories)
      for rid, token, logprob in zip(out.sampling_request_ids, result.token_ids, result.logprobs):
        sampled[rid] = int(token)
        if logprob is not None:
          self._logprobs[rid].append(logprob)
    return sampled

  def _plan_ahead(self, current: _DispatchedStep) -> SchedulerOutput | None:
    """The next step's plan, made while `current` (a greedy step, dispatched) runs, or None when it cannot be made.

    The next step is planned now only when it is certain to be what `Scheduler.schedule()` would plan after this
    step: this step is all decodes (every request computes and samples one token, rows in batch order), greedy;
    no request can finish by length in it; no request waits (none would be admitted); and every request gets the
    room for one more token (no preemption). It then computes, for the same requests in the same order, the token
    this step samples: the program takes it from this step's output on the device, so the host's work for the
    next step (planning, the batch, the dispatch) overlaps this step's computation instead of following it.

    A request that samples a stop token in this step, or that is aborted before the next call, still computes one
    more token in the planned step; `_take_ahead` drops it, and its blocks and state slot were freed by then (the
    device runs the steps in order, so a later step never sees that write). Prefix caching's state blocks are
    never planned ahead: the allocation for the next step releases the state blocks before the one it reads, which
    this step's results would register as checkpoints.
    """
    out = current.out
    if not self.overlap_decode_steps or current.rows is not None or self.scheduler.waiting:
      return None
    if self.manager.uses_state_blocks or len(out.sampling_request_ids) != len(out.scheduled):
      return None
    limit = self.scheduler.max_target_length
    for request, n in out.scheduled:
      p = request.sampling_params
      if n != 1 or not p.plain_argmax:
        return None
      if len(request.output_token_ids) + 1 >= num_generatable_tokens(request.num_prompt_tokens, p.max_tokens, limit):
        return None  # finishes by length in this step
    computed = {}
    for request, _ in out.scheduled:
      rid = request.request_id
      computed[rid] = out.num_computed_tokens[rid] + 1
      if not self.manager.allocate_slots(rid, computed[rid], 1):
        # The scheduler decides who is preempted. The requests before this one keep the room they got: the
        # scheduler's allocation for the same token finds it.
        return None
    return _decode_plan(out.scheduled, computed, out.sampling_request_ids)

  def _take_ahead(self) -> _DispatchedStep | None:
    """The step dispatched one call ahead, without the requests that finished or were aborted since it was planned
    (their rows are ignored); None when there is none or none of its requests is left."""
    ahead, self._ahead = self._ahead, None
    if ahead is None:
      return None
    out = ahead.out
    live = [i for i, (request, _) in enumerate(out.scheduled) if request.status == RequestStatus.RUNNING]
    if len(live) == len(out.scheduled):
      return ahead
    if not live:
      return None
    kept = tuple(out.scheduled[i] for i in live)
    ids = tuple(e.request.request_id for e in kept)
    filtered = _decode_plan(kept, {rid: out.num_computed_tokens[rid] for rid in ids}, ids)
    return _DispatchedStep(filtered, ahead.token_ids, ahead.finite, rows=tuple(live))

  def has_unfinished_requests(self) -> bool:
    """Whether any request is still waiting or running, or an abort is not yet reported by `step()`."""
    return self.scheduler.has_unfinished_requests() or bool(self._aborted)


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


def check_finite_rows(finite: np.ndarray) -> None:
  """Raises like the sampler when a sampled row's logits are not all finite.

  Raises:
    ValueError: row i holds NaN or inf.
  """
  bad = np.flatnonzero(~finite)
  if bad.size:
    raise ValueError(f"logits row {int(bad[0])} holds non-finite values (NaN or inf); the model output is broken")


def metadata_positions(metadata: AttentionMetadata | GroupedAttentionMetadata) -> jax.Array:
  """The positions array the runner passes positionally (the same array as in the metadata)."""
  if isinstance(metadata, AttentionMetadata):
    return metadata.input_positions
  return metadata.groups[0].input_positions
