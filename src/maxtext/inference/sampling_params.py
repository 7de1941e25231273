"""`SamplingParams`: how one request samples its tokens (shaped like vLLM's class of the same name)."""

from __future__ import annotations

import dataclasses
from typing import Any


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings of one request.

  Attributes:
    max_tokens: tokens to generate at most (>= 1); generation also stops at `max_target_length` in total.
    temperature: 0 = greedy (argmax); otherwise logits are divided by it before top-k / top-p.
    top_k: keep the k most likely tokens (-1 = all).
    top_p: keep the smallest set of most likely tokens whose probability sums to at least top_p (1 = all).
    seed: per-request seed; a seeded request draws the same tokens whatever else is in the batch.
    logprobs: None = no logprobs; n >= 0 = the sampled token's logprob plus the n most likely tokens' logprobs.
    stop_token_ids: sampling one of these finishes the request (the token is kept in the output).
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = -1
  top_p: float = 1.0
  seed: int | None = None
  logprobs: int | None = None
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not _is_int(self.max_tokens):
      raise TypeError(f"SamplingParams.max_tokens must be an int, got {type(self.max_tokens).__name__}")
    if self.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
    if not _is_number(self.temperature):
      raise TypeError(f"SamplingParams.temperature must be a number, got {type(self.temperature).__name__}")
    if not self.temperature >= 0.0:  # also rejects NaN
      raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if not _is_int(self.top_k):
      raise TypeError(f"SamplingParams.top_k must be an int, got {type(self.top_k).__name__}")
    if self.top_k != -1 and self.top_k < 1:
      raise ValueError(f"SamplingParams.top_k must be -1 (all tokens) or >= 1, got {self.top_k}")
    if not _is_number(self.top_p):
      raise TypeError(f"SamplingParams.top_p must be a number, got {type(self.top_p).__name__}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
    if self.seed is not None and not _is_int(self.seed):
      raise TypeError(f"SamplingParams.seed must be None or an int, got {type(self.seed).__name__}")
    if self.seed is not None and self.seed < 0:
      raise ValueError(f"SamplingParams.seed must be >= 0, got {self.seed}")
    if self.logprobs is not None:
      if not _is_int(self.logprobs):
        raise TypeError(f"SamplingParams.logprobs must be None or an int, got {type(self.logprobs).__name__}")
      if self.logprobs < 0:
        raise ValueError(f"SamplingParams.logprobs must be None or >= 0, got {self.logprobs}")
    if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
      raise TypeError(f"SamplingParams.stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
    stop = tuple(self.stop_token_ids)
    for token in stop:
      if not _is_int(token) or token < 0:
        raise ValueError(f"SamplingParams.stop_token_ids must hold token ids >= 0, got {token!r}")
    object.__setattr__(self, "stop_token_ids", stop)  # frozen dataclass: normalise a list to a tuple

  @property
  def is_greedy(self) -> bool:
    """Whether sampling is argmax (temperature 0)."""
    return self.temperature == 0.0
