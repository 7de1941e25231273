"""`Request`: one prompt being generated, and its lifecycle status."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from maxtext.inference.sampling_params import SamplingParams

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"


class RequestStatus(enum.Enum):
  """WAITING (never run) -> RUNNING -> FINISHED; RUNNING -> PREEMPTED (waiting again, recomputed) -> RUNNING."""

  WAITING = "waiting"
  RUNNING = "running"
  PREEMPTED = "preempted"
  FINISHED = "finished"


@dataclasses.dataclass
class Request:
  """A request's tokens and progress.

  Attributes:
    request_id: unique id.
    prompt_token_ids: the prompt (non-empty).
    sampling_params: how to sample.
    output_token_ids: tokens generated so far.
    num_computed_tokens: tokens of `all_token_ids` whose K/V (and recurrent state) are in the cache. A preempted
      request restarts from 0 and recomputes prompt + outputs.
    status: lifecycle status.
    arrival_index: order of `Scheduler.add_request` calls (FCFS and "newest" for preemption); -1 until added.
    finish_reason: "length", "stop" or "abort" once finished.
    num_preemptions: how many times the request was preempted.
    num_cached_tokens: prompt tokens served from the prefix cache when the request was first admitted (vLLM's
      `num_cached_tokens`; 0 without prefix caching).
  """

  request_id: str
  prompt_token_ids: Sequence[int]
  sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  num_computed_tokens: int = 0
  status: RequestStatus = RequestStatus.WAITING
  arrival_index: int = -1
  finish_reason: str | None = None
  stop_reason: int | str | None = None  # the stop token id or stop string that finished it (None: eos, length)
  num_preemptions: int = 0
  num_cached_tokens: int = 0

  def __post_init__(self):
    self.prompt_token_ids = tuple(self.prompt_token_ids)
    if not isinstance(self.sampling_params, SamplingParams):
      raise TypeError(
          f"request {self.request_id!r}: sampling_params must be a SamplingParams, got"
          f" {type(self.sampling_params).__name__}"
      )

  @property
  def num_prompt_tokens(self) -> int:
    """Length of the prompt."""
    return len(self.prompt_token_ids)

  @property
  def num_tokens(self) -> int:
    """Prompt plus generated tokens."""
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def all_token_ids(self) -> tuple[int, ...]:
    """Prompt followed by the generated tokens."""
    return self.prompt_token_ids + tuple(self.output_token_ids)

  @property
  def num_remaining_tokens(self) -> int:
    """Tokens still to compute before the request can sample again."""
    return self.num_tokens - self.num_computed_tokens

  @property
  def is_finished(self) -> bool:
    """Whether the request has finished."""
    return self.status == RequestStatus.FINISHED
