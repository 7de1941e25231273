"""`LLM` and its outputs: an offline API shaped like vLLM's, over the reference runner."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_collections
from tqdm import tqdm

from maxtext.checkpoint import load_run_config
from maxtext.inference import prompts as prompt_checks
from maxtext.inference.chat_template import render_chat_template
from maxtext.inference.engine import FinishedRequest, LLMEngine
from maxtext.inference.sampler import TokenLogprobs
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.tokenizer import tokenizer_from_config

logger = logging.getLogger(__name__)


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
  num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (enable_prefix_caching)


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

  def prompt_token_ids(self, prompt: Any) -> list[int]:
    """The ids `generate` sends to the model for one prompt (checked, chat-templated as the config says).

    Raises:
      TypeError, ValueError: as `generate` for a bad prompt.
    """
    return self._prompt_ids(prompt, 0)[1]

  def _prompt_ids(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
    prompt_checks.check_prompt(prompt, f"prompts[{index}]")
    if isinstance(prompt, str):
      return prompt, self._encode_text(prompt)
    return None, [int(t) for t in prompt]

  def generate(
      self,
      prompts: str | Sequence[str] | Sequence[Sequence[int]],
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = False,
      on_token: Callable[[int, int], None] | None = None,
      cancel: threading.Event | None = None,
  ) -> list[RequestOutput]:
    """Generates a completion for every prompt (strings or lists of token ids), in prompt order.

    `SamplingParams.max_tokens` is an upper bound: a request also stops when prompt + output reaches
    `max_target_length` (finish reason "length"), so a larger `max_tokens` is not an error; the progress bar counts
    the tokens that can actually be generated, and a request that finishes early (eos, a stop token) lowers its
    total to what was generated, so the bar ends at 100%. With `use_chat_template=true` in the config, string
    prompts are sent as one user message through the model's chat template (see `apply_chat_template`).
    `on_token(prompt index, token id)` is called for every token as soon as it is sampled (in step order), e.g. to
    stream text. When `cancel` is set (from a signal handler or another thread), the call aborts its unfinished
    requests and raises KeyboardInterrupt before its next step. `generate_iter` hands out each output as soon as it
    is ready instead.

    Raises:
      TypeError: `prompts` is not a string, a list of token ids or a list of those (bytes, None, a number), a
        prompt holds a non-int token, or `sampling_params` holds something other than SamplingParams.
      ValueError: an empty prompt (`""` or `[]`), text that is not valid UTF-8, a list of SamplingParams whose
        length is not the number of prompts, or a prompt the scheduler rejects (too long, token ids outside the
        vocabulary). In every case no request of the call is queued and running requests are not disturbed.
    """
    return list(self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm, on_token=on_token, cancel=cancel))

  def generate_iter(
      self,
      prompts: str | Sequence[str] | Sequence[Sequence[int]],
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = False,
      on_token: Callable[[int, int], None] | None = None,
      cancel: threading.Event | None = None,
  ) -> Iterator[RequestOutput]:
    """`generate` as an iterator: yields each prompt's output, in prompt order, as soon as it and every earlier
    prompt's output are finished (the later prompts keep decoding together between the yields).

    The prompts and sampling params are checked here, before the iterator is returned (the errors of `generate`);
    the requests are queued when the first output is asked for, so the scheduler's rejections come from that first
    `next()`. Closing the iterator early (or an exception while it runs) aborts the call's unfinished requests.
    """
    prompts = prompt_checks.normalize_prompts(prompts)
    if sampling_params is None:
      sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
      sampling_params = [sampling_params] * len(prompts)
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, bytes)):
      raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
    prompt_checks.check_sequence_of(sampling_params, SamplingParams, "sampling_params")
    if len(sampling_params) != len(prompts):
      raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; give one or one each")
    # Every prompt is converted and checked before any is queued, so a bad one leaves no request behind.
    prepared = [self._prompt_ids(prompt, i) for i, prompt in enumerate(prompts)]
    return self._run(prepared, list(sampling_params), use_tqdm, on_token, cancel)

  def _run(
      self,
      prepared: Sequence[tuple[str | None, list[int]]],
      sampling_params: Sequence[SamplingParams],
      use_tqdm: bool,
      on_token: Callable[[int, int], None] | None,
      cancel: threading.Event | None,
  ) -> Iterator[RequestOutput]:
    """Queues the checked prompts, steps the engine until they are all finished, yields them in prompt order."""
    order = self.engine.add_requests([(ids, params) for (_, ids), params in zip(prepared, sampling_params)])
    texts = {rid: text for rid, (text, _) in zip(order, prepared)}
    positions = {rid: i for i, rid in enumerate(order)}
    done: dict[str, FinishedRequest] = {}
    limit = int(self.cfg.max_target_length)
    # The bar counts this call's tokens against what can still be generated: a request's reachable tokens while it
    # runs, its actual count once it finished (eos, a stop token or an abort end it early), so it ends at 100%.
    reachable = {
        rid: prompt_checks.num_generatable_tokens(len(ids), p.max_tokens, limit)
        for rid, (_, ids), p in zip(order, prepared, sampling_params)
    }
    counted = dict.fromkeys(order, 0)
    emitted = 0
    try:
      with tqdm(
          total=sum(reachable.values()), desc="generating", unit="tok", file=sys.stderr, disable=not use_tqdm
      ) as progress:
        while self.engine.has_unfinished_requests():
          if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt("generate cancelled")
          finished_now = self.engine.step()
          for finished in finished_now:
            done[finished.request_id] = finished
          if on_token is not None:
            _report_tokens(self.engine.last_sampled, positions, on_token)
          _advance(progress, self.engine.last_sampled, finished_now, reachable, counted)
          if emitted < len(order) and order[emitted] in done:
            progress.clear()  # the caller may write to the terminal the bar is drawn on
            while emitted < len(order) and order[emitted] in done:
              emitted += 1
              yield self._output(done[order[emitted - 1]], texts[order[emitted - 1]])
            progress.refresh()
      for rid in order[emitted:]:
        emitted += 1
        yield self._output(done[rid], texts[rid])
    except BaseException:  # GeneratorExit included: the caller stopped asking
      self._abort_unfinished(order, done)
      raise

  def abort_request(self, request_id: str) -> None:
    """Aborts a request of the engine (see `LLMEngine.abort_request`); `generate` reports it as "abort".

    Raises:
      ValueError: no unfinished request has this id.
    """
    self.engine.abort_request(request_id)

  def _abort_unfinished(self, order: Sequence[str], done: dict[str, FinishedRequest]) -> None:
    """After an interrupted call (Ctrl-C, an error in a step): frees the call's unfinished requests' caches."""
    for rid in order:
      if rid not in done and self.engine.scheduler.is_unfinished(rid):
        self.engine.abort_request(rid)
    logger.info("generate interrupted: aborted its unfinished requests")

  def _encode_text(self, prompt: str) -> list[int]:
    """A text prompt's ids: chat-templated when the config says `use_chat_template`, else encoded with bos."""
    if self.cfg.use_chat_template:
      return self.apply_chat_template([{"role": "user", "content": prompt}])
    return self.tokenizer.encode(prompt, add_bos=True)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of chat `messages` under the model's own chat template.

    The template decides about bos / eos (it receives their texts as `bos_token` / `eos_token`); the rendered text
    is tokenized without adding special tokens.

    Raises:
      ChatTemplateError: the model has no chat template, or it fails to render.
    """
    tokenizer = self.tokenizer
    source = getattr(tokenizer, "path", "the byte-level tokenizer")
    bos = tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.chat_template else ""
    eos = tokenizer.token_text(tokenizer.eos_token_id) if tokenizer.chat_template else ""
    text = render_chat_template(
        tokenizer.chat_template,
        messages,
        bos_token=bos,
        eos_token=eos,
        add_generation_prompt=add_generation_prompt,
        source=source,
    )
    return tokenizer.encode(text, add_special_tokens=False)

  def _output(self, finished: FinishedRequest, prompt: str | None) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=self.tokenizer.decode(finished.output_token_ids),
        token_ids=finished.output_token_ids,
        logprobs=finished.logprobs,
        finish_reason=finished.finish_reason,
    )
    return RequestOutput(
        finished.request_id, prompt, finished.prompt_token_ids, (completion,), finished.num_cached_tokens
    )


def _advance(
    progress: tqdm,
    sampled: Mapping[str, int],
    finished_now: Sequence[FinishedRequest],
    reachable: dict[str, int],
    counted: dict[str, int],
) -> None:
  """Moves the bar by this step's tokens of the call's requests (`sampled`: request id -> token). A request that
  finished in the step (`finished_now`) counts its actual tokens, and the total drops by those it will never
  generate (eos, a stop token, an abort), so once every request is finished the bar stands at its total."""
  for rid in sampled:
    if rid in counted:
      counted[rid] += 1
  for finished in finished_now:
    rid = finished.request_id
    if rid in counted:
      actual = len(finished.output_token_ids)
      if actual != reachable[rid]:
        progress.total -= reachable[rid] - actual
        reachable[rid] = actual
      counted[rid] = actual  # a token sampled after a stop and dropped does not count
  progress.update(sum(counted.values()) - progress.n)


def _report_tokens(
    sampled: Mapping[str, int], positions: Mapping[str, int], on_token: Callable[[int, int], None]
) -> None:
  """Calls `on_token(prompt index, token)` for each token one step sampled, in prompt order."""
  for rid in sorted(sampled, key=positions.__getitem__):
    on_token(positions[rid], sampled[rid])
