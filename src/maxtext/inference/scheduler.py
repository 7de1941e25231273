"""Continuous batching with chunked prefill and recompute preemption.

One `schedule()` call picks the requests of the next model step and how many tokens each computes:
  1. running requests, DECODES FIRST (exactly one token to compute), then running prefills, each group in arrival
     order; a request takes `min(tokens it still has to compute, remaining budget)` tokens of the
     `max_num_batched_tokens` budget (chunked prefill);
  2. if nothing was preempted in this call, waiting requests in arrival order (FCFS, preempted ones included)
     while fewer than `max_num_seqs` requests run and budget is left; the first one that cannot get blocks stops
     admission (no overtaking), it simply waits. With `admission_reserve=none` (vLLM's rule) a request is admitted
     when the blocks of the tokens it computes now are free; with `max_tokens` the free blocks must also cover what
     every running request and it will still take up to their `max_tokens` (`KVCacheManager.blocks_to_grow`), so
     requests are not admitted only to be preempted when they grow (a lone request is always admitted).
When a running request cannot get blocks, the NEWEST running request (largest arrival index, possibly the
request itself; were it already scheduled in this call, its tokens would return to the budget) is preempted:
its blocks and state slot are freed, `num_computed_tokens` resets to 0 and it rejoins the waiting queue keeping
its generated tokens, so it later computes prompt + outputs again as one prefill and continues where it stopped.
With prefix caching its full blocks stay cached when freed (until evicted, its last blocks first), so it resumes
from the longest prefix still cached and recomputes only the rest; `recomputed_tokens` counts the tokens computed
a second time. The oldest request is therefore never preempted for a newer one and always advances, so every
request finishes. If a request cannot get blocks even with no other request holding any, it can never fit:
`schedule()` raises.

Prefix caching (`enable_prefix_caching=true`): a request being admitted starts from the longest cached prefix
every KV-cache group holds (`KVCacheManager.find_prefix_hit`) and computes only the rest; with recurrent layers a
step stops at the next state boundary (`schedulable_tokens`) so that the state there is checkpointed. The
blocks a step completed are registered for later requests in `update_from_output`.

Length rule: a prompt must be shorter than `max_target_length` (room for one generated token); generation stops
at `max_tokens` generated tokens, at a stop token (or `eos_token_id`), or when prompt + output reaches
`max_target_length` (finish reason "length").
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.prefix_cache import PrefixHit
from maxtext.inference.prompts import num_generatable_tokens
from maxtext.inference.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestStatus

logger = logging.getLogger(__name__)
RESERVE_NONE = "none"
RESERVE_MAX_TOKENS = "max_tokens"
ADMISSION_RESERVES = (RESERVE_NONE, RESERVE_MAX_TOKENS)


class ScheduledRequest(NamedTuple):
  """A request in a step, and the number of tokens it computes (unpacks as `(request, num_new_tokens)`)."""

  request: Request
  num_new_tokens: int


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """The plan of one model step.

  Attributes:
    scheduled: the step's requests, decodes (one token) first, then the rest; in each part, the order they were
      scheduled (arrival order among running requests, then newly admitted ones).
    num_computed_tokens: request id -> tokens already in the cache at the start of the step.
    sampling_request_ids: requests that compute their last known token in this step and so sample one, in
      `scheduled` order (a chunked prefill that does not finish its prompt samples nothing).
    preempted_request_ids: requests preempted by this call.
    slots_to_zero: recurrent state slots released since the previous call; zero them before running the step.
  """

  scheduled: tuple[ScheduledRequest, ...]
  num_computed_tokens: Mapping[str, int]
  sampling_request_ids: tuple[str, ...]
  preempted_request_ids: tuple[str, ...]
  slots_to_zero: tuple[int, ...]

  @property
  def num_scheduled_tokens(self) -> int:
    """Tokens computed in the step."""
    return sum(n for _, n in self.scheduled)

  @property
  def num_decodes(self) -> int:
    """Requests computing exactly one token (they lead `scheduled`)."""
    return sum(1 for _, n in self.scheduled if n == 1)

  @property
  def is_empty(self) -> bool:
    """Whether no request is scheduled."""
    return not self.scheduled


class RequestNeverFitsError(RuntimeError):
  """A request cannot get its blocks even with no other request holding any: the pools are too small for it."""


def _is_token(token: Any, vocab_size: int) -> bool:
  """An integer (Python or NumPy, not bool) in [0, vocab_size)."""
  return isinstance(token, numbers.Integral) and not isinstance(token, bool) and 0 <= token < vocab_size


def _arrival(request: Request) -> int:
  return request.arrival_index


class Scheduler:
  """Continuous-batching scheduler over a `KVCacheManager` (see the module docstring for the policy).

  Args:
    cfg: the loaded config (max_num_seqs, max_num_batched_tokens, admission_reserve, max_target_length,
      vocab_size).
    kv_cache_manager: allocates blocks and state slots.
    eos_token_id: sampling this token finishes a request with reason "stop" (None: only `stop_token_ids` stop).

  Raises:
    ValueError: `cfg.admission_reserve` is not one of `ADMISSION_RESERVES`.
  """

  def __init__(self, cfg: Any, kv_cache_manager: KVCacheManager, *, eos_token_id: int | None = None):
    self.max_num_seqs = int(cfg.max_num_seqs)
    self.max_num_batched_tokens = int(cfg.max_num_batched_tokens)
    self.admission_reserve = str(cfg.admission_reserve)
    if self.admission_reserve not in ADMISSION_RESERVES:
      raise ValueError(f"admission_reserve={self.admission_reserve!r}: must be one of {', '.join(ADMISSION_RESERVES)}")
    self.max_target_length = int(cfg.max_target_length)
    self.vocab_size = int(cfg.vocab_size)
    self.kv_cache_manager = kv_cache_manager
    self.eos_token_id = eos_token_id
    self.waiting: list[Request] = []  # sorted by arrival index
    self.running: list[Request] = []  # sorted by arrival index
    self._next_arrival = 0
    self._active_ids: set[str] = set()
    # Prefix caching: tokens looked up and tokens found, over every admission (re-admissions after preemption too).
    self.prefix_cache_queries = 0
    self.prefix_cache_hits = 0
    # Tokens computed a second time because a preemption dropped them (the prefix cache gave back the rest).
    self.recomputed_tokens = 0
    self._computed_before: dict[str, int] = {}  # preempted request id -> the most tokens it had computed

  # ------------------------------------------------------------------ requests
  def add_request(self, request: Request) -> None:
    """Queues a new request (FCFS).

    Raises:
      TypeError, ValueError: see `check_request`.
    """
    self.check_request(request)
    request.prompt_token_ids = tuple(int(t) for t in request.prompt_token_ids)  # NumPy ints -> Python ints
    request.arrival_index = self._next_arrival
    self._next_arrival += 1
    self._active_ids.add(request.request_id)
    self.waiting.append(request)
    logger.debug("added request %s (%d prompt tokens)", request.request_id, request.num_prompt_tokens)

  def check_request(self, request: Request) -> None:
    """Raises if `add_request` would reject the request; changes nothing (callers check a batch before queueing).

    Raises:
      TypeError: not a Request.
      ValueError: a duplicate id of an unfinished request, a request that already ran, an empty prompt, token ids
        outside [0, vocab_size), a prompt of `max_target_length` tokens or more, or a request that can never fit in
        a block pool that keeps every block.
    """
    if not isinstance(request, Request):
      raise TypeError(f"add_request needs a Request, got {type(request).__name__}")
    rid = request.request_id
    if rid in self._active_ids:
      raise ValueError(f"request {rid!r}: an unfinished request with this id already exists")
    if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
      raise ValueError(f"request {rid!r}: must be new (WAITING, no computed or generated tokens), got {request.status}")
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
      raise ValueError(f"request {rid!r}: the prompt is empty; it needs at least one token")
    for token in request.prompt_token_ids:
      if not _is_token(token, self.vocab_size):
        raise ValueError(f"request {rid!r}: prompt token {token!r} must be an int in [0, vocab_size={self.vocab_size})")
    if num_prompt >= self.max_target_length:
      raise ValueError(
          f"request {rid!r}: the prompt has {num_prompt} tokens but must be shorter than"
          f" max_target_length={self.max_target_length} to leave room for a generated token"
      )
    final_length = num_prompt + num_generatable_tokens(
        num_prompt, request.sampling_params.max_tokens, self.max_target_length
    )
    # The last generated token is never fed back, so the cache holds at most final_length - 1 tokens.
    self.kv_cache_manager.check_request_fits(rid, final_length - 1)

  def has_unfinished_requests(self) -> bool:
    """Whether any request is waiting or running."""
    return bool(self.waiting or self.running)

  def is_unfinished(self, request_id: str) -> bool:
    """Whether a request with this id is waiting or running."""
    return request_id in self._active_ids

  @property
  def num_unfinished_requests(self) -> int:
    """Waiting plus running requests."""
    return len(self.waiting) + len(self.running)

  # ------------------------------------------------------------------ scheduling
  def schedule(self) -> SchedulerOutput:
    """Plans the next step (see the module docstring).

    Raises:
      RequestNeverFitsError: a request cannot get blocks although no other request holds any (a RuntimeError).
    """
    budget = self.max_num_batched_tokens
    scheduled: dict[str, int] = {}  # request id -> tokens, in scheduling order
    requests: dict[str, Request] = {}
    preempted: list[str] = []
    decodes = [r for r in self.running if r.num_remaining_tokens == 1]
    prefills = [r for r in self.running if r.num_remaining_tokens > 1]
    for request in decodes + prefills:
      if request.status != RequestStatus.RUNNING:
        continue  # preempted earlier in this call
      # Each admission costs budget and admission stops when it runs out, so there are never more running
      # requests than budget tokens, and decodes (1 token each) lead: every running request gets a token.
      assert budget > 0, "more running requests than max_num_batched_tokens"
      n = self.kv_cache_manager.schedulable_tokens(request.num_computed_tokens, min(request.num_remaining_tokens, budget))
      while not self.kv_cache_manager.allocate_slots(request.request_id, request.num_computed_tokens, n):
        victim = self.running[-1]
        if victim is request and len(self.running) == 1:
          raise self._never_fits(request, n)
        self._preempt(victim)
        preempted.append(victim.request_id)
        budget += scheduled.pop(victim.request_id, 0)
        if victim is request:
          break
      else:
        scheduled[request.request_id] = n
        requests[request.request_id] = request
        budget -= n

    if not preempted:
      self._admit(budget, scheduled, requests)
    return self._output(scheduled, requests, preempted)

  def _admit(self, budget: int, scheduled: dict[str, int], requests: dict[str, Request]) -> None:
    """Admits waiting requests in arrival order into `scheduled` / `requests` while seats, budget and blocks last
    (and, with `admission_reserve=max_tokens`, the blocks the running requests may still take)."""
    reserve = self._running_growth() if self.admission_reserve == RESERVE_MAX_TOKENS else 0
    while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
      request = self.waiting[0]
      hit = None
      # A request that asks for its prompt's log-probabilities computes every position (vLLM does the same).
      if self.kv_cache_manager.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
        hit = self.kv_cache_manager.find_prefix_hit(request.all_token_ids)
      computed = hit.num_tokens if hit is not None else 0
      n = self.kv_cache_manager.schedulable_tokens(computed, min(request.num_tokens - computed, budget))
      if self.admission_reserve == RESERVE_MAX_TOKENS and self.running:
        # A step's prefill chunks may hold blocks beyond the sliding windows for that step: one allowance for all.
        spill = self.kv_cache_manager.window_spill_blocks(self.max_num_batched_tokens, len(self.running) + 1)
        need = reserve + self._growth(request, hit if computed else None) + spill
        if need > self.kv_cache_manager.num_free_blocks():
          logger.debug("request %s waits: %d blocks may still be taken, fewer are free", request.request_id, need)
          return
      if not self.kv_cache_manager.allocate_slots(request.request_id, computed, n, hit if computed else None):
        if not self.running:
          raise self._never_fits(request, n)
        return
      if hit is not None:
        self._record_prefix_hit(request, computed)
      self.waiting.pop(0)
      request.status = RequestStatus.RUNNING
      bisect.insort(self.running, request, key=_arrival)
      scheduled[request.request_id] = n
      requests[request.request_id] = request
      budget -= n
      if self.admission_reserve == RESERVE_MAX_TOKENS:
        reserve += self._growth(request)

  def _final_cached_tokens(self, request: Request) -> int:
    """The most tokens the request's cache will hold: up to `max_tokens` generated (or `max_target_length`), the
    last generated one never fed back."""
    num_prompt = request.num_prompt_tokens
    limit = num_generatable_tokens(num_prompt, request.sampling_params.max_tokens, self.max_target_length)
    return num_prompt + limit - 1

  def _growth(self, request: Request, hit: PrefixHit | None = None) -> int:
    """Free blocks the request may still take until it reaches `max_tokens` (from its hit if it holds none)."""
    return self.kv_cache_manager.blocks_to_grow(request.request_id, self._final_cached_tokens(request), hit)

  def _running_growth(self) -> int:
    return sum(self._growth(request) for request in self.running)

  def _output(self, scheduled: dict[str, int], requests: dict[str, Request], preempted: list[str]) -> SchedulerOutput:
    """The plan of `scheduled` (request id -> tokens): decodes first, the requests whose step ends their known
    tokens sample, and the state slots freed since the last plan are zeroed."""
    order = [rid for rid, n in scheduled.items() if n == 1] + [rid for rid, n in scheduled.items() if n > 1]
    batch = tuple(ScheduledRequest(requests[rid], scheduled[rid]) for rid in order)
    computed = {rid: requests[rid].num_computed_tokens for rid in order}
    sampling = tuple(rid for rid in order if computed[rid] + scheduled[rid] == requests[rid].num_tokens)
    return SchedulerOutput(
        scheduled=batch,
        num_computed_tokens=computed,
        sampling_request_ids=sampling,
        preempted_request_ids=tuple(preempted),
        slots_to_zero=tuple(self.kv_cache_manager.drain_slots_to_zero()),
    )

  def _record_prefix_hit(self, request: Request, num_cached_tokens: int) -> None:
    request.num_computed_tokens = num_cached_tokens
    if request.num_preemptions == 0:
      request.num_cached_tokens = num_cached_tokens
    self.prefix_cache_queries += request.num_tokens
    self.prefix_cache_hits += num_cached_tokens
    if num_cached_tokens:
      logger.debug(
          "request %s: %d of %d tokens from the prefix cache", request.request_id, num_cached_tokens, request.num_tokens
      )

  def _preempt(self, request: Request) -> None:
    self.running.remove(request)
    self.kv_cache_manager.free(request.request_id)  # under prefix caching its full blocks stay findable
    rid = request.request_id
    self._computed_before[rid] = max(self._computed_before.get(rid, 0), request.num_computed_tokens)
    request.num_computed_tokens = 0
    request.status = RequestStatus.PREEMPTED
    request.num_preemptions += 1
    bisect.insort(self.waiting, request, key=_arrival)
    logger.info("preempted request %s (%d tokens computed so far)", request.request_id, self._computed_before[rid])

  def _never_fits(self, request: Request, n: int) -> RequestNeverFitsError:
    manager = self.kv_cache_manager
    return RequestNeverFitsError(
        f"request {request.request_id!r} can never fit: computing tokens [{request.num_computed_tokens},"
        f" {request.num_computed_tokens + n}) fails although no other request holds blocks"
        f" ({manager.num_free_blocks()} of {manager.num_blocks - 1} blocks free for"
        f" {len(manager.attention_group_ids)} attention groups; {manager.num_free_state_slots()} free state slots);"
        " raise kv_cache_memory_bytes or num_kv_blocks, or lower max_num_batched_tokens for sliding-window groups"
    )

  def abort_request(self, request_id: str, reason: str = FINISH_ABORT) -> Request:
    """Finishes an unfinished request now (reason "abort", or `reason`: "stop" for a stop string the caller found
    in its text), returning its blocks and state slot at once.

    Call it between steps (after `update_from_output`, before the next `schedule`); the other requests are not
    touched, so their tokens do not change. A released state slot is zeroed before the next step, as for any
    finished request.

    Returns:
      The aborted request (its generated tokens so far are kept).

    Raises:
      ValueError: no unfinished request has this id (never added, already finished or aborted).
    """
    if request_id not in self._active_ids:
      raise ValueError(f"request {request_id!r}: no unfinished request has this id (never added, or already finished)")
    request = next((r for r in self.running if r.request_id == request_id), None)
    if request is not None:
      self._finish(request, reason)
      return request
    request = next(r for r in self.waiting if r.request_id == request_id)
    self.waiting.remove(request)
    self._computed_before.pop(request_id, None)
    # A waiting request holds nothing: a new one never allocated, a preempted one freed everything.
    assert not self.kv_cache_manager.has_request(request_id), request_id
    self._active_ids.discard(request_id)
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    return request

  # ------------------------------------------------------------------ results
  def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int]) -> list[Request]:
    """Advances the step's requests, appends sampled tokens and frees finished requests.

    Args:
      scheduler_output: the plan returned by the last `schedule()` call.
      sampled_token_ids: request id -> sampled token, exactly for `scheduler_output.sampling_request_ids`.

    Returns:
      The requests that finished in this step, in batch order.

    Raises:
      ValueError: the sampled ids do not match `sampling_request_ids`, a token is not a valid id, or the output
        was already applied (stale).
    """
    expected = set(scheduler_output.sampling_request_ids)
    given = set(sampled_token_ids)
    if given != expected:
      raise ValueError(
          f"sampled_token_ids must hold exactly the sampling requests {sorted(expected)}; missing"
          f" {sorted(expected - given)}, unexpected {sorted(given - expected)}"
      )
    for request, _ in scheduler_output.scheduled:
      rid = request.request_id
      if (
          request.status != RequestStatus.RUNNING
          or request.num_computed_tokens != scheduler_output.num_computed_tokens[rid]
      ):
        raise ValueError(f"request {rid!r}: this scheduler output is stale (already applied, or the request changed)")
    for rid, token in sampled_token_ids.items():
      if not _is_token(token, self.vocab_size):
        raise ValueError(f"request {rid!r}: sampled token {token!r} must be an int in [0, vocab_size={self.vocab_size})")
    finished = []
    for request, n in scheduler_output.scheduled:
      self._count_recomputed(request, n)
      request.num_computed_tokens += n
      if self.kv_cache_manager.enable_prefix_caching:  # register the blocks this step completed
        self.kv_cache_manager.cache_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
      if request.request_id not in expected:
        continue
      token = int(sampled_token_ids[request.request_id])
      request.output_token_ids.append(token)
      reason = self._finish_reason(request, token)
      if reason is not None:
        self._finish(request, reason)
        finished.append(request)
    return finished

  def _count_recomputed(self, request: Request, n: int) -> None:
    """Counts the part of the step's `n` tokens the request had computed before a preemption."""
    mark = self._computed_before.get(request.request_id)
    if mark is None:
      return
    start = request.num_computed_tokens
    self.recomputed_tokens += max(0, min(start + n, mark) - start)
    if start + n >= mark:
      del self._computed_before[request.request_id]

  def _finish_reason(self, request: Request, token: int) -> str | None:
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
      if token == self.eos_token_id and not params.ignore_eos:
        return FINISH_STOP
      if token in params.stop_token_ids:
        request.stop_reason = token
        return FINISH_STOP
    limit = num_generatable_tokens(request.num_prompt_tokens, params.max_tokens, self.max_target_length)
    if num_output >= limit:
      return FINISH_LENGTH
    return None

  def _finish(self, request: Request, reason: str) -> None:
    self.running.remove(request)
    self._computed_before.pop(request.request_id, None)
    self.kv_cache_manager.free(request.request_id)
    self._active_ids.discard(request.request_id)
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    logger.debug("request %s finished (%s) with %d tokens", request.request_id, reason, len(request.output_token_ids))
