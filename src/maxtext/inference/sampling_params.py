"""`SamplingParams`: how one request samples its tokens, with the fields, defaults and meanings of vLLM's class of the
same name (text generation).

What vLLM offers and this engine does not (guided decoding, logit bias, allowed or bad words, logits processors) is
refused with one error naming the field, rather than accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

# Below this temperature a request is greedy (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5

# Fields vLLM's SamplingParams has that this engine does not implement, and what each is.
_UNSUPPORTED = {
    "structured_outputs": "guided decoding",
    "logit_bias": "logit bias",
    "allowed_token_ids": "an allowed-token list",
    "bad_words": "bad words",
    "logits_processors": "logits processors",
}


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(message: str, error: type[Exception] = ValueError) -> None:
  raise error(f"SamplingParams.{message}")


def _check_int(name: str, value: Any, low: int, optional: bool = False) -> None:
  if optional and value is None:
    return
  if not _is_int(value):
    _fail(f"{name} must be {'None or ' if optional else ''}an int, got {type(value).__name__}", TypeError)
  if value < low:
    _fail(f"{name} must be {'None or ' if optional else ''}>= {low}, got {value}")


def _check_number(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
  if not _is_number(value):
    _fail(f"{name} must be a number, got {type(value).__name__}", TypeError)
  inside = (low < value if open_low else low <= value) and value <= high  # NaN fails every comparison
  if not inside:
    _fail(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value}")


def _check_bool(name: str, value: Any) -> None:
  if not isinstance(value, bool):
    _fail(f"{name} must be True or False, got {value!r}", TypeError)


def _normalized_stop(stop: Any) -> tuple[str, ...]:
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = (stop,)
  if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
    _fail(f"stop must be None, a string or a list of strings, got {stop!r}", TypeError)
  if any(not s for s in stop):
    _fail(f"stop must hold non-empty strings, got {list(stop)!r}")
  return tuple(stop)


def _normalized_stop_token_ids(ids: Any) -> tuple[int, ...]:
  if ids is None:
    return ()
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
    _fail(f"stop_token_ids must be None or a sequence of ints, got {ids!r}", TypeError)
  ids = tuple(ids)
  for token in ids:
    if not _is_int(token) or token < 0:
      _fail(f"stop_token_ids must hold token ids >= 0, got {token!r}")
  return ids


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings of one request (vLLM's fields and defaults; the CLI passes its own greedy default).

  The logits of a step are processed in vLLM's order: `min_tokens` masks the stop tokens, the penalties apply, a
  greedy request (temperature below 1e-5) takes the argmax of that, and a sampling one divides by the temperature,
  keeps the tokens `min_p`, `top_k` and `top_p` keep, and draws one. Logprobs are those of the raw logits.

  Attributes:
    n: completions per prompt; with a seed, completion i uses seed + i (as vLLM's parallel sampling does).
    presence_penalty: subtracted from the logit of every token the output already holds ([-2, 2]).
    frequency_penalty: subtracted once per occurrence in the output so far ([-2, 2]).
    repetition_penalty: a token of the prompt or output has a positive logit divided by it, a negative one
      multiplied (> 0; 1 = off).
    temperature: 0 = greedy; otherwise logits are divided by it ([0, 2]).
    top_p: keep the smallest set of most likely tokens whose probability sums to at least top_p ((0, 1]).
    top_k: keep the k most likely tokens (0 or -1 = all).
    min_p: drop the tokens whose probability is below min_p times the most likely one's ([0, 1]).
    seed: per-request seed; a seeded request draws the same tokens whatever else is in the batch.
    stop: strings that end the output when generated; the text stops before them (unless
      `include_stop_str_in_output`), the token ids keep the token that completed them.
    stop_token_ids: sampling one of these finishes the request (the token is kept in the output).
    ignore_eos: generate past the end-of-sequence token.
    max_tokens: tokens to generate at most (None: up to `max_target_length` in total, which always bounds it).
    min_tokens: tokens to generate before eos or `stop_token_ids` may be sampled.
    logprobs: None = none; k >= 0 = the sampled token's log-probability and the k most likely tokens'.
    detokenize: False leaves `text` empty (no stop strings then).
    skip_special_tokens: drop special tokens from `text`.
    include_stop_str_in_output: keep the matched stop string at the end of `text`.
    prompt_logprobs: None = none; k >= 0 = each prompt token's log-probability (from the second on) and the k most
      likely tokens' at its position. A request asking for them computes its whole prompt (no prefix-cache hit).
    structured_outputs, logit_bias, allowed_token_ids, bad_words, logits_processors: vLLM's; not
      supported here, so setting one raises.
  """

  n: int = 1
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  ignore_eos: bool = False
  max_tokens: int | None = 16
  min_tokens: int = 0
  logprobs: int | None = None
  detokenize: bool = True
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  prompt_logprobs: int | None = None
  structured_outputs: Any = None
  logit_bias: Any = None
  allowed_token_ids: Any = None
  bad_words: Any = None
  logits_processors: Any = None

  def __post_init__(self):
    for name, what in _UNSUPPORTED.items():
      if getattr(self, name) is not None:
        _fail(f"{name} ({what}) is not supported by this engine; leave it None")
    _check_int("n", self.n, 1)
    _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
    _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
    _check_number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, open_low=True)
    if math.isinf(self.repetition_penalty):
      _fail(f"repetition_penalty must be finite, got {self.repetition_penalty}")
    _check_number("temperature", self.temperature, 0.0, 2.0)
    _check_number("top_p", self.top_p, 0.0, 1.0, open_low=True)
    _check_int("top_k", self.top_k, -1)
    _check_number("min_p", self.min_p, 0.0, 1.0)
    _check_int("seed", self.seed, 0, optional=True)
    for name in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output"):
      _check_bool(name, getattr(self, name))
    _check_int("max_tokens", self.max_tokens, 1, optional=True)
    _check_int("min_tokens", self.min_tokens, 0)
    if self.max_tokens is not None and self.min_tokens > self.max_tokens:
      _fail(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
    _check_int("logprobs", self.logprobs, 0, optional=True)
    _check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
    stop = _normalized_stop(self.stop)
    if stop and not self.detokenize:
      _fail(f"stop strings need detokenize=True (the text is what they match), got stop={list(stop)!r}")
    object.__setattr__(self, "stop", stop)  # frozen dataclass: normalise to tuples
    object.__setattr__(self, "stop_token_ids", _normalized_stop_token_ids(self.stop_token_ids))
    if self.is_greedy and self.n > 1:  # vLLM's rule: greedy sequences would all be the same
      _fail(f"n must be 1 when using greedy sampling, got {self.n}")
    if self.is_greedy:  # as vLLM does: the filters mean nothing for an argmax
      object.__setattr__(self, "top_p", 1.0)
      object.__setattr__(self, "top_k", 0)
      object.__setattr__(self, "min_p", 0.0)

  @property
  def is_greedy(self) -> bool:
    """Whether the token is the argmax (temperature below 1e-5)."""
    return self.temperature < GREEDY_TEMPERATURE

  @property
  def has_penalties(self) -> bool:
    """Whether the logits depend on the tokens so far (penalties, or `min_tokens` masking the stop tokens)."""
    return (
        self.presence_penalty != 0.0
        or self.frequency_penalty != 0.0
        or self.repetition_penalty != 1.0
        or self.min_tokens > 0
    )

  @property
  def plain_argmax(self) -> bool:
    """Whether the argmax of the raw logits is all the request needs: greedy, no penalties, no logprobs of the
    output or the prompt (the engine then takes the argmax on the device)."""
    return self.is_greedy and not self.has_penalties and self.logprobs is None and self.prompt_logprobs is None
