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
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from maxtext.causal_lm import CausalLM
from maxtext.inference import compilation_cache, memory_budget, step_programs
from maxtext.inference.batch import BatchInputs, build_batch, next_power_of_two
from maxtext.inference.engine_build import EngineWeights, make_kv_cache_manager, with_default_kernel_backend
from maxtext.inference.engine_programs import (
    EnginePrograms,
    no_previous_tokens,
    sampling_logits_indices,
    step_inputs,
)
from maxtext.inference.prompts import num_generatable_tokens
from maxtext.inference.request import FINISH_STOP, Request, RequestStatus
from maxtext.inference.sampler import Sampler, TokenHistory, TokenLogprobs, token_logprobs
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from maxtext.models import sharding

logger = logging.getLogger(__name__)
# What a start is doing (loading, compiling), for a command line to show while it waits (`maxtext-decode` on a
# terminal); nothing is printed unless a program turns it on.
status = logging.getLogger("maxtext.status")
COMPILE_NOTICE_S = 1.0
# Prompt log-probabilities are computed this many positions at a time: a long prompt's full-vocabulary logits at
# once would take gigabytes.
PROMPT_LOGITS_ROWS = 256
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
  recomputed_tokens: int = 0
  aborted_requests: int = 0
  overlapped_steps: int = 0
  wall_time_s: float = 0.0
  compile_time_s: float = 0.0
  compiling_steps: int = 0
  steady_wall_time_s: float = 0.0
  steady_generated_tokens: int = 0
  prefix_cache_queries: int = 0
  prefix_cache_hits: int = 0
  peak_running_requests: int = 0
  peak_kv_blocks: int = 0
  cached_tokens_per_request: dict[str, int] = dataclasses.field(default_factory=dict)

  def as_dict(self) -> dict[str, Any]:
    """Plain dict, with generated tokens per second and the prefix-cache hit rate.

    `wall_time_s` is the time of every step. `compile_time_s` is the time of the `compiling_steps` steps that made a
    program (traced, lowered or compiled one, read one from a cache, or waited for the background compile), their
    own computation included; `steady_wall_time_s` and `steady_generated_tokens` are the time and tokens of the
    other steps, and `generated_tokens_per_s` their ratio: the decode speed without compilation (0.0 until a step
    runs without compiling).
    `overlapped_steps` counts the greedy decode steps dispatched before the previous step's tokens reached the
    host (`overlap_decode_steps`). `prefix_cache_queries` / `prefix_cache_hits` count tokens looked up / found in
    the prefix cache at every admission (re-admissions after a preemption too); `cached_tokens_per_request` maps
    each finished request to the prompt tokens it skipped when first admitted. All are 0 / empty with
    `enable_prefix_caching=false`. `recomputed_tokens` counts the tokens (prompt and fed-back output) computed a
    second time because a preemption dropped them: all a preempted request had computed without prefix caching,
    with it only what was not found cached on resume. `peak_running_requests` is the most requests a step ran together;
    `peak_kv_blocks` the most blocks of the one KV-cache pool in use at once (of `num_kv_blocks - 1` usable).
    """
    out = dataclasses.asdict(self)
    steady = self.steady_wall_time_s
    out["generated_tokens_per_s"] = self.steady_generated_tokens / steady if steady > 0 else 0.0
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
  # Per prompt position: None at position 0 (nothing predicts it), else the prompt token's log-probability.
  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


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
    step_programs.listen_for_compile_time()
    self.mesh = sharding.make_mesh(cfg)
    self.cfg = cfg = with_default_kernel_backend(cfg, self.mesh)
    # Host memory only: on a CPU mesh the parameters and caches live in this process's memory; a TPU's are not.
    self.memory_need = memory_budget.check_fits(cfg) if all(d.platform == "cpu" for d in self.mesh.devices.flat) else None
    rng_key = jax.random.key(cfg.init_seed)
    self.weights = EngineWeights(cfg, CausalLM.from_config(cfg, rng_key, self.mesh))  # the model's keys only
    self.backend = self.weights.backend
    self.manager = make_kv_cache_manager(cfg)
    self.layer_map = self.manager.layer_name_to_kvcache_index
    self.recurrent_slots = self.manager.recurrent_slot_indices
    self.scheduler = Scheduler(cfg, self.manager, eos_token_id=eos_token_id)
    self.sampler = Sampler(cfg.seed, eos_token_id=eos_token_id)
    self.stats = EngineStats()
    self._logprobs: dict[str, list[TokenLogprobs]] = {}
    self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    self._aborted: list[FinishedRequest] = []
    # request id -> token sampled for it by the last `step` (read by streaming callers).
    self.last_sampled: dict[str, int] = {}
    self._next_id = 0
    self.programs = EnginePrograms(
        cfg, self.mesh, self.compilation_cache_dir, self.weights, self.manager, lambda: self.kv_caches, self._count_trace
    )
    self.programs.start_background_compile(self.manager.cache_shapes())
    self.kv_caches = self.weights.model.shard_kv_caches(self.manager.allocate_caches())
    self._zero_slots([])  # compiles the zeroing program now (no row is written), not in the first request's path
    if not self.weights.model.is_dummy:
      self.weights.load(rng_key)
    # A greedy decode step dispatched before the previous step's tokens reached the host, with its plan.
    self._ahead: _DispatchedStep | None = None
    self.overlap_decode_steps = bool(cfg.overlap_decode_steps)

  @property
  def model(self) -> CausalLM:
    """The model, over the arrays the steps read."""
    return self.weights.model

  @property
  def prepared_bytes(self) -> int:
    """The bytes the kernel backend re-laid (`prepare_params`)."""
    return self.weights.prepared_bytes

  @property
  def placed_bytes(self) -> int | None:
    """The bytes the kernel backend placed (`place_params`), None until its thread has run."""
    return self.weights.placed_bytes

  @property
  def weights_from_cache(self) -> bool:
    """Whether the prepared weights came from the weight cache."""
    return self.weights.from_cache

  def _count_trace(self) -> None:
    self.stats.step_traces += 1

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
    if request.sampling_params.prompt_logprobs is not None:
      self._prompt_logprobs[request.request_id] = [None] * request.num_prompt_tokens
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
    prompt_logprobs = self._prompt_logprobs.pop(r.request_id, None)
    return FinishedRequest(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.prompt_token_ids),
        output_token_ids=tuple(r.output_token_ids),
        logprobs=tuple(self._logprobs.pop(r.request_id)) if r.request_id in self._logprobs else None,
        finish_reason=r.finish_reason,
        num_cached_tokens=r.num_cached_tokens,
        stop_reason=r.stop_reason,
        prompt_logprobs=None if prompt_logprobs is None else tuple(prompt_logprobs),
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
      index = np.full((max(self.programs.zero_rows_bucket, next_power_of_two(len(slots))),), states[0].shape[0], np.int32)
      index[: len(slots)] = slots
      self.kv_caches[s] = self.programs.zero_rows(states, index)

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
    compile_before = step_programs.compile_seconds_in_this_thread()
    aborted, self._aborted = self._aborted, []
    self.last_sampled = {}
    self.weights.adopt_copies()
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
      if params and all(p.plain_argmax for p in params) and not self._prompt_logprobs.keys() & requests.keys():
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
    self.weights.start_placing()  # after the first step: its programs are compiled
    finished = self.scheduler.update_from_output(out, sampled)
    self.stats.steps += 1
    self.stats.scheduled_tokens += out.num_scheduled_tokens
    self.stats.generated_tokens += len(sampled)
    self.stats.prefix_cache_queries = self.scheduler.prefix_cache_queries
    self.stats.prefix_cache_hits = self.scheduler.prefix_cache_hits
    self.stats.recomputed_tokens = self.scheduler.recomputed_tokens
    self.stats.peak_running_requests = max(self.stats.peak_running_requests, len(out.scheduled))
    self.stats.peak_kv_blocks = self.manager.peak_used_blocks
    self._count_time(
        time.perf_counter() - start, step_programs.compile_seconds_in_this_thread() - compile_before, sampled
    )
    return aborted + [self._finished(r) for r in finished]

  def _count_time(self, elapsed: float, compile_s: float, sampled: dict[str, int]) -> None:
    self.stats.wall_time_s += elapsed
    if compile_s > 0.0:  # nested programs time their tracing again: the events only tell that a step compiled
      self.stats.compile_time_s += elapsed
      self.stats.compiling_steps += 1
    else:
      self.stats.steady_wall_time_s += elapsed
      self.stats.steady_generated_tokens += len(sampled)

  def _dispatch_greedy(
      self, out: SchedulerOutput, batch: BatchInputs, prev_tokens: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """Dispatches the fused greedy step of `batch` (the plan `out`); returns its token ids and finite flags, on the
    device (the caches are replaced by the step's at once).

    With `prev_tokens` (the previous step's token ids, on the device), the batch's decode rows take their input
    tokens from it (a plan one step ahead: `_plan_ahead`).
    """
    step_greedy, indices = self.programs.greedy_program(batch, out.sampling_request_ids)
    if prev_tokens is None:
      prev_tokens, num_prev = no_previous_tokens(indices.shape[0])
    else:
      num_prev = np.int32(batch.num_decodes)
    self.programs.wait_for_background_compile(batch)  # never compile the same program twice at once
    inputs = step_inputs(self.weights.leaves, self.kv_caches, batch)
    self.kv_caches, token_ids, finite = step_greedy(*inputs, indices, prev_tokens, num_prev, self.layer_map)
    return token_ids, finite

  def _run_and_sample(
      self, out: SchedulerOutput, requests: dict[str, Request], params: list[SamplingParams]
  ) -> dict[str, int]:
    """Runs the step of `out`, then samples on the host (any sampling parameters, logprobs); returns the tokens."""
    batch = build_batch(self.cfg, out, self.manager)
    inputs = step_inputs(self.weights.leaves, self.kv_caches, batch)
    self.kv_caches, hidden = self.programs.program("step", batch.padded_num_tokens)(*inputs, self.layer_map)
    self._record_prompt_logprobs(out, batch, hidden)
    sampled: dict[str, int] = {}
    if params:
      indices = sampling_logits_indices(batch, out.sampling_request_ids)
      logits = np.asarray(self.programs.logits(self.weights.leaves, hidden, indices))[: len(params)]
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

  def _record_prompt_logprobs(self, out: SchedulerOutput, batch: BatchInputs, hidden: jax.Array) -> None:
    """Fills the prompt log-probabilities of the positions this step computed, for the requests that asked.

    Hidden row j of a request's chunk (position start + j) predicts the prompt token at start + j + 1. A request
    recomputed after a preemption writes the same positions again.
    """
    for request, n in out.scheduled:
      entries = self._prompt_logprobs.get(request.request_id)
      if entries is None:
        continue
      start = out.num_computed_tokens[request.request_id]
      targets = list(range(start + 1, min(start + n, request.num_prompt_tokens - 1) + 1))
      first_row = int(batch.query_start_loc[batch.request_ids.index(request.request_id)])
      num_top = request.sampling_params.prompt_logprobs
      for lo in range(0, len(targets), PROMPT_LOGITS_ROWS):
        chunk = targets[lo : lo + PROMPT_LOGITS_ROWS]
        indices = np.full((next_power_of_two(len(chunk)),), first_row + chunk[0] - 1 - start, np.int32)
        indices[: len(chunk)] = [first_row + t - 1 - start for t in chunk]
        logits = np.asarray(self.programs.logits(self.weights.leaves, hidden, indices))[: len(chunk)]
        check_finite_rows(np.all(np.isfinite(logits), axis=-1))
        for t, row in zip(chunk, logits):
          entries[t] = token_logprobs(row, request.prompt_token_ids[t], num_top)

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


def check_finite_rows(finite: np.ndarray) -> None:
  """Raises like the sampler when a sampled row's logits are not all finite.

  Raises:
    ValueError: row i holds NaN or inf.
  """
  bad = np.flatnonzero(~finite)
  if bad.size:
    raise ValueError(f"logits row {int(bad[0])} holds non-finite values (NaN or inf); the model output is broken")
