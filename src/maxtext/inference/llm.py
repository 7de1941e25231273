"""`LLM` and its outputs: an offline API shaped like vLLM's, over the reference runner."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
from tqdm import tqdm

from maxtext.checkpoint import load_run_config
from maxtext.inference.engine import FinishedRequest, LLMEngine
from maxtext.inference.sampler import TokenLogprobs
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.tokenizer import tokenizer_from_config


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
  """One generated sequence."""

  index: int
  text: str
  token_ids: tuple[int, ...]
  logprobs: tuple[TokenLogprobs, ...] | None
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """A finished request: its prompt and its completion(s)."""

  request_id: str
  prompt: str | None
  prompt_token_ids: tuple[int, ...]
  outputs: tuple[CompletionOutput, ...]


class LLM:
  """Offline generation: `LLM(config_path, **overrides).generate(prompts, SamplingParams(...))`.

  Args:
    config_path: base YAML (default: the package's base.yml).
    argv: extra `key=value` strings, as on the command line.
    config: an already-built config (`load_run_config(...)`), used as it is; then no other argument may be given.
    **overrides: config keys, e.g. `model_name="qwen3-next-tiny"`.

  Raises:
    TypeError: `config` is not a built config, or is combined with a path, argv or overrides.
  """

  def __init__(
      self,
      config_path: str | None = None,
      *,
      argv: Sequence[str] = (),
      config: ml_collections.FrozenConfigDict | None = None,
      **overrides: Any,
  ):
    if config is not None:
      if not isinstance(config, ml_collections.FrozenConfigDict):
        raise TypeError(f"LLM(config=...) takes a config built by load_run_config, got {type(config).__name__}")
      if config_path or argv or overrides:
        raise TypeError("LLM(config=...) takes the built config alone; pass overrides when building it instead")
      self.cfg = config
    else:
      self.cfg = load_run_config(([config_path] if config_path else []) + list(argv), **overrides)
    self.tokenizer = tokenizer_from_config(self.cfg)
    self.engine = LLMEngine(self.cfg, eos_token_id=self.tokenizer.eos_token_id)

  def _prompt_ids(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
      return prompt, self.tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      return None, list(prompt)
    raise TypeError(f"prompts[{index}] must be a string or a list of token ids, got {type(prompt).__name__}")

  def generate(
      self,
      prompts: str | Sequence[str] | Sequence[Sequence[int]],
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = False,
  ) -> list[RequestOutput]:
    """Generates a completion for every prompt (strings or lists of token ids), in prompt order.

    Raises:
      TypeError: a prompt is neither a string nor a list of ints.
      ValueError: a list of SamplingParams whose length is not the number of prompts, or a prompt the scheduler
        rejects (too long, empty, token ids outside the vocabulary). Either way no request of the call is queued.
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    if sampling_params is None:
      sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
      sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
      raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; give one or one each")
    # Every prompt is converted and checked before any is queued, so a bad one leaves no request behind.
    prepared = [self._prompt_ids(prompt, i) for i, prompt in enumerate(prompts)]
    order = self.engine.add_requests([(ids, params) for (_, ids), params in zip(prepared, sampling_params)])
    texts = {rid: text for rid, (text, _) in zip(order, prepared)}
    done: dict[str, FinishedRequest] = {}
    total = sum(p.max_tokens for p in sampling_params)
    with tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, disable=not use_tqdm) as progress:
      while self.engine.has_unfinished_requests():
        before = self.engine.stats.generated_tokens
        for finished in self.engine.step():
          done[finished.request_id] = finished
        progress.update(self.engine.stats.generated_tokens - before)
    return [self._output(done[rid], texts[rid]) for rid in order]

  def _output(self, finished: FinishedRequest, prompt: str | None) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=self.tokenizer.decode(finished.output_token_ids),
        token_ids=finished.output_token_ids,
        logprobs=finished.logprobs,
        finish_reason=finished.finish_reason,
    )
    return RequestOutput(finished.request_id, prompt, finished.prompt_token_ids, (completion,))
