"""What `LLM.generate` returns, with the fields and meanings of vLLM's `RequestOutput`, `CompletionOutput` and
`Logprob`, so code written against vLLM reads them unchanged."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
  """One token's log-probability at a position.

  Attributes:
    logprob: its log-probability under the raw logits.
    rank: 1 + the number of tokens more likely than it.
    decoded_token: its text on its own.
  """

  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


# One position's log-probabilities: the sampled token's and the `logprobs` most likely, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# A prompt's: None for the first token (nothing precedes it), then the prompt token's and the most likely ones.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class RequestMetrics:
  """When a request arrived, produced its first token and finished (`time.time()` seconds), and its token counts."""

  arrival_time: float
  first_token_time: float | None
  finished_time: float
  num_prompt_tokens: int
  num_generation_tokens: int


@dataclasses.dataclass
class CompletionOutput:
  """One generated sequence of a request.

  Attributes:
    index: its index among the request's `n` sequences.
    text: the generated text (without a matched stop string unless `include_stop_str_in_output`).
    token_ids: the generated token ids.
    cumulative_logprob: the sum of the sampled tokens' log-probabilities, None unless logprobs were asked for.
    logprobs: per generated token, `{token id: Logprob}` of the sampled token and the `logprobs` most likely ones.
    finish_reason: "stop" (eos, a stop token or string), "length" (`max_tokens` or `max_target_length`), "abort".
    stop_reason: the stop token id or stop string that ended it; None for eos and the other reasons.
  """

  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float | None
  logprobs: SampleLogprobs | None
  finish_reason: str | None = None
  stop_reason: int | str | None = None

  def finished(self) -> bool:
    """Whether the sequence is finished (as vLLM's method of the same name)."""
    return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
  """A request's prompt and its completions.

  Attributes:
    request_id: the engine's id of the request (of its first sequence when `n > 1`).
    prompt: the prompt text, None for a token-id prompt.
    prompt_token_ids: the ids sent to the model.
    prompt_logprobs: per prompt token, None for the first, then `{token id: Logprob}` of the prompt token and the
      `SamplingParams.prompt_logprobs` most likely; None unless asked for.
    outputs: the `n` completions, by index.
    finished: whether every completion is finished (always True from `generate`).
    metrics: timings and token counts.
    num_cached_tokens: prompt tokens served from the prefix cache (`enable_prefix_caching`).
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  prompt_logprobs: PromptLogprobs | None
  outputs: list[CompletionOutput]
  finished: bool
  metrics: RequestMetrics | None = None
  num_cached_tokens: int = 0
