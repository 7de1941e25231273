"""`LLM`: the offline API shaped like vLLM's (its constructor's `model`, `generate`, `chat`, `get_tokenizer`, its
prompt forms and outputs), over the reference runner.

vLLM's constructor keywords that name a key of this package under another name are translated
(`_VLLM_KEYWORDS`); what vLLM offers and this engine does not (LoRA, multimodal inputs, beam search) raises one
error naming it. The rest of the keywords are this package's config keys.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_collections
from tqdm import tqdm

from maxtext.checkpoint import load_run_config
from maxtext.inference import prompts as prompt_checks
from maxtext.inference.chat_template import render_chat_template
from maxtext.inference.engine import FinishedRequest, LLMEngine
from maxtext.inference.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from maxtext.inference.sampler import TokenLogprobs
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.tokenizer import tokenizer_from_config

logger = logging.getLogger(__name__)

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]

# vLLM's constructor keywords -> this package's config keys of the same meaning.
_VLLM_KEYWORDS = {
    "max_model_len": "max_target_length",
    "tokenizer": "tokenizer_path",
    "tensor_parallel_size": "ici_tensor_parallelism",
}
# The sampling fields of a Hugging Face folder's generation_config.json that vLLM takes as the model's defaults
# (`LLM.get_default_sampling_params`), by their SamplingParams names.
GENERATION_CONFIG_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
# vLLM's features this engine does not have: the keyword (constructor or generate) -> what it asks for.
_REFUSED = {
    "enable_lora": "LoRA adapters",
    "lora_request": "LoRA adapters",
    "limit_mm_per_prompt": "multimodal inputs",
    "multi_modal_data": "multimodal inputs",
    "speculative_config": "speculative decoding",
}


def _refuse(name: str, where: str) -> None:
  raise NotImplementedError(f"{where}: {name} ({_REFUSED[name]}) is not supported by maxtext's engine")


def model_keys(model: str) -> dict[str, str]:
  """The config keys vLLM's `LLM(model=...)` value stands for: a `.gguf` file, a Hugging Face folder, or a
  bundled model name (`configs/models/<name>.yml`).

  Raises:
    TypeError: `model` is not a string.
    ValueError: it is empty.
  """
  if not isinstance(model, (str, os.PathLike)):
    raise TypeError(f"LLM(model=...) must be a bundled model name, a Hugging Face folder or a .gguf file, got {model!r}")
  model = os.fspath(model)
  if not model:
    raise ValueError("LLM(model=...) is empty; give a bundled model name, a Hugging Face folder or a .gguf file")
  if model.endswith(".gguf"):
    return {"gguf_model_path": model}
  if os.path.isdir(model):
    return {"hf_model_path": model}
  return {"model_name": model}


class LLM:
  """Offline generation: `LLM(model, **keys).generate(prompts, SamplingParams(...))`, as vLLM's `LLM`.

  Args:
    model: a bundled model name (`"smollm2-135m-instruct"`), a Hugging Face folder, a `.gguf` file, or a config
      YAML path (`*.yml`, `*.yaml`; the package's base.yml when None).
    argv: extra `key=value` strings, as on the command line.
    config: an already-built config (`load_run_config(...)`), used as it is; then no other argument may be given.
    **overrides: config keys, e.g. `max_num_seqs=16`, and vLLM's `max_model_len`, `tokenizer`,
      `tensor_parallel_size` (as `max_target_length`, `tokenizer_path`, `ici_tensor_parallelism`).

  Raises:
    TypeError: `config` is not a built config, or is combined with a model, argv or overrides.
    NotImplementedError: a vLLM feature this engine does not have (`enable_lora`, multimodal limits).
  """

  def __init__(
      self,
      model: str | os.PathLike | None = None,
      *,
      argv: Sequence[str] = (),
      config: ml_collections.FrozenConfigDict | None = None,
      **overrides: Any,
  ):
    for name in overrides:
      if name in _REFUSED:
        _refuse(name, "LLM")
    if config is not None:
      if not isinstance(config, ml_collections.FrozenConfigDict):
        raise TypeError(f"LLM(config=...) takes a config built by load_run_config, got {type(config).__name__}")
      if model or argv or overrides:
        raise TypeError("LLM(config=...) takes the built config alone; pass overrides when building it instead")
      self.cfg = config
    else:
      model = overrides.pop("model", model)
      keys = {_VLLM_KEYWORDS.get(k, k): v for k, v in overrides.items()}
      yaml = []
      if model is not None and os.fspath(model).endswith((".yml", ".yaml")):
        yaml = [os.fspath(model)]
      elif model is not None:
        keys = {**model_keys(model), **keys}
      self.cfg = load_run_config(yaml + list(argv), **keys)
    self.default_sampling_params = default_sampling_params(self.cfg.hf_model_path)
    self.tokenizer = tokenizer_from_config(self.cfg)
    self.engine = LLMEngine(self.cfg, eos_token_id=self.tokenizer.eos_token_id)

  def get_default_sampling_params(self) -> SamplingParams:
    """What `generate` and `chat` use without SamplingParams, as vLLM's method of the same name: the sampling fields
    of the Hugging Face folder's `generation_config.json` (`GENERATION_CONFIG_FIELDS`) over SamplingParams'
    defaults; `SamplingParams()` for a model without one."""
    return self.default_sampling_params

  def get_tokenizer(self) -> Any:
    """The tokenizer (`encode`, `decode`, `eos_token_id`, `chat_template`)."""
    return self.tokenizer

  def prompt_token_ids(self, prompt: Any) -> list[int]:
    """The ids `generate` sends to the model for one prompt (checked, chat-templated as the config says).

    Raises:
      TypeError, ValueError: as `generate` for a bad prompt.
    """
    return self._prompt_ids(prompt, 0)[1]

  def _prompt_ids(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
    where = f"prompts[{index}]"
    if isinstance(prompt, Mapping):
      prompt = _dict_prompt(prompt, where)
    prompt_checks.check_prompt(prompt, where)
    if isinstance(prompt, str):
      return prompt, self._encode_text(prompt)
    return None, [int(t) for t in prompt]

  def generate(
      self,
      prompts: Any,
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = True,
      on_token: Callable[[int, int], None] | None = None,
      cancel: threading.Event | None = None,
      **vllm_only: Any,
  ) -> list[RequestOutput]:
    """Generates completions for every prompt, in prompt order (vLLM's `LLM.generate`).

    Prompts are strings, token-id lists, or vLLM's dicts `{"prompt": text}` / `{"prompt_token_ids": ids}`, alone or
    in a list. `SamplingParams.max_tokens` is an upper bound: a request also stops when prompt + output reaches
    `max_target_length` (finish reason "length"), so a larger `max_tokens` is not an error. With `n > 1` a prompt's
    `n` sequences decode as separate requests (sharing their prompt's cached blocks with prefix caching) and come
    back as the `outputs` of one `RequestOutput`. The progress bar counts the tokens that can be generated when
    every request has a `max_tokens` below `max_target_length` (a request that finishes early lowers the total to
    what it generated), else the finished requests; either way it ends at 100%.
    With `use_chat_template=true` in the config, string prompts are sent as one user message through the model's
    chat template (see `apply_chat_template`). `on_token(prompt index, token id)` is called for every token as soon
    as it is sampled (in step order), e.g. to stream text. When `cancel` is set (from a signal handler or another
    thread), the call aborts its unfinished requests and raises KeyboardInterrupt before its next step.
    `generate_iter` hands out each output as soon as it is ready instead.

    Raises:
      TypeError: `prompts` is not one of the accepted forms (bytes, None, a number), a prompt holds a non-int
        token, or `sampling_params` holds something other than SamplingParams.
      ValueError: an empty prompt (`""` or `[]`), text that is not valid UTF-8, a list of SamplingParams whose
        length is not the number of prompts, or a prompt the scheduler rejects (too long, token ids outside the
        vocabulary). In every case no request of the call is queued and running requests are not disturbed.
      NotImplementedError: a vLLM keyword this engine does not support (`lora_request`, multimodal data).
    """
    return list(
        self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm, on_token=on_token, cancel=cancel, **vllm_only)
    )

  def chat(
      self,
      messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = True,
      add_generation_prompt: bool = True,
      **vllm_only: Any,
  ) -> list[RequestOutput]:
    """Generates replies to one conversation or a list of them, through the model's chat template (vLLM's
    `LLM.chat`); `RequestOutput.prompt` is the rendered template text.

    Raises:
      TypeError: `messages` is not a list of `{"role", "content"}` mappings or a list of those.
      ChatTemplateError: the model has no chat template, or it fails to render.
    """
    conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
    for i, conversation in enumerate(conversations):
      prompt_checks.check_sequence_of(conversation, Mapping, f"messages[{i}]")
    prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in conversations]
    outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **vllm_only)
    for output in outputs:
      output.prompt = self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
    return outputs

  def generate_iter(
      self,
      prompts: Any,
      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
      *,
      use_tqdm: bool = False,
      on_token: Callable[[int, int], None] | None = None,
      cancel: threading.Event | None = None,
      **vllm_only: Any,
  ) -> Iterator[RequestOutput]:
    """`generate` as an iterator: yields each prompt's output, in prompt order, as soon as it and every earlier
    prompt's output are finished (the later prompts keep decoding together between the yields).

    The prompts and sampling params are checked here, before the iterator is returned (the errors of `generate`);
    the requests are queued when the first output is asked for, so the scheduler's rejections come from that first
    `next()`. Closing the iterator early (or an exception while it runs) aborts the call's unfinished requests.
    """
    for name, value in vllm_only.items():
      if name not in _REFUSED:
        raise TypeError(f"LLM.generate got an unexpected keyword argument {name!r}")
      if value is not None:
        _refuse(name, "LLM.generate")
    prompts = prompt_checks.normalize_prompts(prompts)
    if sampling_params is None:
      sampling_params = self.default_sampling_params
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
    """Queues the checked prompts (`n` requests each), steps the engine until they are all finished, yields them
    in prompt order."""
    sequences = [
        (i, ids, child) for i, ((_, ids), p) in enumerate(zip(prepared, sampling_params)) for child in _children(p)
    ]
    order = self.engine.add_requests([(ids, child) for _, ids, child in sequences])
    call = _Call(self, order, sequences, [text for text, _ in prepared], sampling_params)
    try:
      total, unit = call.bar_total()
      with tqdm(total=total, desc="generating", unit=unit, file=sys.stderr, disable=not use_tqdm) as progress:
        while self.engine.has_unfinished_requests():
          if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt("generate cancelled")
          finished_now = self.engine.step()
          call.record(self.engine.last_sampled, finished_now)
          if on_token is not None:
            _report_tokens(self.engine.last_sampled, call.prompt_index, on_token)
          call.advance(progress, self.engine.last_sampled, finished_now)
          ready = list(call.ready())
          if ready:
            progress.clear()  # the caller may write to the terminal the bar is drawn on
            yield from ready
            progress.refresh()
      yield from call.ready()
    except BaseException:  # GeneratorExit included: the caller stopped asking
      self._abort_unfinished(order, call.done)
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

  def prompt_logprobs(self, finished: FinishedRequest) -> PromptLogprobs | None:
    """A request's prompt log-probabilities as vLLM reports them: None for the first position, then per prompt token
    `{token id: Logprob}` of it and the `prompt_logprobs` most likely; None when the request asked for none."""
    if finished.prompt_logprobs is None:
      return None
    return [None if lp is None else self.position_logprobs(lp) for lp in finished.prompt_logprobs]

  def position_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
    """One position's `{token id: Logprob}`: the sampled token first, then the most likely ones by rank."""
    entries = {lp.token_id: Logprob(lp.logprob, lp.rank, self._token_text(lp.token_id))}
    for rank, (token, value) in enumerate(lp.top, start=1):
      entries.setdefault(token, Logprob(value, rank, self._token_text(token)))
    return entries

  def _token_text(self, token: int) -> str:
    return self.tokenizer.decode([token], skip_special_tokens=False)

  def completion(self, index: int, finished: FinishedRequest, params: SamplingParams) -> CompletionOutput:
    """A finished request as vLLM reports it: its text (cut before a stop string), logprobs and reasons."""
    ids = list(finished.output_token_ids)
    text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens) if params.detokenize else ""
    reason, stop_reason = finished.finish_reason, finished.stop_reason
    match = stop_string_match(text, params.stop)
    if match is not None:
      at, stop = match
      text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
      reason, stop_reason = "stop", stop
    logprobs: SampleLogprobs | None = None
    cumulative = None
    if finished.logprobs is not None:
      logprobs = [self.position_logprobs(lp) for lp in finished.logprobs]
      cumulative = float(sum(lp.logprob for lp in finished.logprobs))
    return CompletionOutput(index, text, ids, cumulative, logprobs, reason, stop_reason)


class _Call:
  """The bookkeeping of one `generate` call: its sequences (`n` per prompt), their tokens so far, the stop strings
  found, the progress bar's counts, and the outputs ready to hand out in prompt order."""

  def __init__(
      self,
      llm: LLM,
      order: Sequence[str],
      sequences: Sequence[tuple[int, list[int], SamplingParams]],
      texts: Sequence[str | None],
      params: Sequence[SamplingParams],
  ):
    self.llm, self.texts, self.params = llm, texts, params
    self.prompt_index = {rid: i for rid, (i, _, _) in zip(order, sequences)}
    self.child = {rid: p for rid, (_, _, p) in zip(order, sequences)}
    self.groups: list[list[str]] = [[] for _ in texts]
    for rid, (i, _, _) in zip(order, sequences):
      self.groups[i].append(rid)
    limit = int(llm.cfg.max_target_length)
    self.reachable = {
        rid: prompt_checks.num_generatable_tokens(len(ids), p.max_tokens, limit)
        for rid, (_, ids, p) in zip(order, sequences)
    }
    self.by_tokens = all(p.max_tokens is not None and p.max_tokens < limit for _, _, p in sequences)
    self.counted = dict.fromkeys(order, 0)
    self.tokens: dict[str, list[int]] = {rid: [] for rid in order}
    self.done: dict[str, FinishedRequest] = {}
    self.arrival = time.time()
    self.first_token: dict[str, float] = {}
    self.finished_at: dict[str, float] = {}
    self.emitted = 0

  def bar_total(self) -> tuple[int, str]:
    """The progress bar's total and unit: the tokens the call can generate when every sequence has a
    `max_tokens` below `max_target_length`, else its sequences (a run until eos has no token count to promise)."""
    if self.by_tokens:
      return sum(self.reachable.values()), "tok"
    return len(self.reachable), "req"

  def advance(self, progress: tqdm, sampled: Mapping[str, int], finished_now: Sequence[FinishedRequest]) -> None:
    """Moves the bar by one step: its tokens (`_advance`), or the sequences it finished."""
    if self.by_tokens:
      _advance(progress, sampled, finished_now, self.reachable, self.counted)
      return
    _advance(_Uncounted(), sampled, finished_now, self.reachable, self.counted)
    progress.set_postfix_str(f"{sum(self.counted.values())} tok", refresh=False)
    progress.update(len(self.done) - progress.n)

  def record(self, sampled: Mapping[str, int], finished_now: Sequence[FinishedRequest]) -> None:
    """Takes one step's tokens and finished requests; finishes a request whose text now holds a stop string."""
    now = time.time()
    for finished in finished_now:
      if finished.request_id in self.tokens:
        self.done[finished.request_id] = finished
        self.finished_at[finished.request_id] = now
    for rid, token in sampled.items():
      if rid not in self.tokens:
        continue
      self.first_token.setdefault(rid, now)
      self.tokens[rid].append(token)
      stops = self.child[rid].stop
      if stops and rid not in self.done:
        text = self.llm.tokenizer.decode(self.tokens[rid], skip_special_tokens=self.child[rid].skip_special_tokens)
        match = stop_string_match(text, stops)
        if match is not None:
          self.llm.engine.finish_request(rid, match[1])

  def ready(self) -> Iterator[RequestOutput]:
    """The outputs of the prompts whose sequences are all finished, from the first not yet handed out."""
    while self.emitted < len(self.groups) and all(rid in self.done for rid in self.groups[self.emitted]):
      yield self._output(self.emitted)
      self.emitted += 1

  def _output(self, i: int) -> RequestOutput:
    rids = self.groups[i]
    first = self.done[rids[0]]
    completions = [self.llm.completion(k, self.done[rid], self.child[rid]) for k, rid in enumerate(rids)]
    metrics = RequestMetrics(
        arrival_time=self.arrival,
        first_token_time=min((self.first_token[r] for r in rids if r in self.first_token), default=None),
        finished_time=max(self.finished_at[r] for r in rids),
        num_prompt_tokens=len(first.prompt_token_ids),
        num_generation_tokens=sum(len(self.done[r].output_token_ids) for r in rids),
    )
    return RequestOutput(
        request_id=first.request_id,
        prompt=self.texts[i],
        prompt_token_ids=list(first.prompt_token_ids),
        prompt_logprobs=self.llm.prompt_logprobs(first),
        outputs=completions,
        finished=True,
        metrics=metrics,
        num_cached_tokens=first.num_cached_tokens,
    )


def default_sampling_params(folder: str) -> SamplingParams:
  """SamplingParams with the sampling fields of `folder`'s `generation_config.json` (none: no folder, no file).

  Raises:
    ValueError: the file is not a JSON object, or a field's value is out of SamplingParams' bounds (named, with the
      file).
  """
  path = os.path.join(folder, "generation_config.json") if folder else ""
  if not path or not os.path.isfile(path):
    return SamplingParams()
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: cannot be read as JSON ({e})") from e
  if not isinstance(config, Mapping):
    raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")
  fields = {name: config[key] for key, name in GENERATION_CONFIG_FIELDS.items() if config.get(key) is not None}
  try:
    return SamplingParams(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: its sampling fields {fields} are not valid SamplingParams: {e}") from e


def _children(params: SamplingParams) -> list[SamplingParams]:
  """The `n` single-sequence requests of a prompt: sequence i of a seeded request uses seed + i (as vLLM does)."""
  if params.n == 1:
    return [params]
  return [
      dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)
  ]


def stop_string_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
  """The earliest stop string in `text` and where it starts (the first listed on a tie), or None."""
  best = None
  for stop in stops:
    at = text.find(stop)
    if at >= 0 and (best is None or at < best[0]):
      best = (at, stop)
  return best


def _dict_prompt(prompt: Mapping[str, Any], where: str) -> Any:
  """vLLM's dict prompt forms: `{"prompt": text}` or `{"prompt_token_ids": ids}`."""
  if "multi_modal_data" in prompt:
    _refuse("multi_modal_data", where)
  keys = set(prompt) & {"prompt", "prompt_token_ids"}
  if len(keys) != 1 or set(prompt) - {"prompt", "prompt_token_ids"}:
    raise TypeError(f'{where} must be {{"prompt": text}} or {{"prompt_token_ids": ids}}, got keys {sorted(prompt)}')
  return prompt[keys.pop()]


class _Uncounted:
  """What `_advance` needs of a bar, for counting tokens without one."""

  total = n = 0

  def update(self, n: int) -> None:
    """Counts `n` more, as tqdm does."""
    self.n += n


def _advance(
    progress: tqdm | _Uncounted,
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
