"""The work of `maxtext-decode`: config, prompts, generation and output.

`maxtext.decode.main` imports this module once its Ctrl-C handling is in place: importing it loads JAX, Flax and
the model code, which takes seconds, and an interrupt then must end the CLI as cleanly as one during decoding.
"""

from __future__ import annotations

import errno
import json
import select
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

from maxtext.checkpoint import load_run_config
from maxtext.configs.errors import MissingDependencyError
from maxtext.inference import kv_cache_capacity, memory_budget
from maxtext.inference import prompts as prompt_checks
from maxtext.inference.engine_build import make_kv_cache_manager
from maxtext.inference.llm import LLM, RequestOutput
from maxtext.inference.prompts_file import FilePrompt, read_prompts_file
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import RequestNeverFitsError
from maxtext.inference.streaming import TextStreamer
from maxtext.kv_cache import kv_cache_spec
from maxtext.integration.vllm.environment import PluginEnvironmentError

# Errors that mean "the input is wrong", reported as one line with exit status 2. Anything else is a bug: traceback.
# RequestNeverFitsError: the configured cache pool (kv_cache_memory_bytes or num_kv_blocks) is too small for the request.
# OSError: a path that cannot be read (missing, a folder where a file is expected, no permission).
# MissingDependencyError: an optional package the run needs (tokenizers, jinja2, ...) is not installed.
USER_ERRORS = (
    ValueError,
    TypeError,
    NotImplementedError,
    OSError,
    KeyError,
    RequestNeverFitsError,
    MissingDependencyError,
    PluginEnvironmentError,  # e.g. kernel_backend=tpu_inference without tpu-inference installed
)


def sampling_params_from_config(cfg: ml_collections.FrozenConfigDict) -> SamplingParams:
  """The decode keys as SamplingParams (MaxText conventions: top_k <= 0 and top_p <= 0 mean "off").

  max_new_tokens=0 (the default) becomes max_tokens=max_target_length: a request generates until eos, or until
  prompt + output fill max_target_length.
  """
  return SamplingParams(
      max_tokens=cfg.max_new_tokens or cfg.max_target_length,
      temperature=cfg.decode_sampling_temperature,
      top_k=cfg.decode_sampling_top_k if cfg.decode_sampling_top_k > 0 else -1,
      top_p=cfg.decode_sampling_nucleus_p if cfg.decode_sampling_nucleus_p > 0 else 1.0,
      seed=cfg.seed,
      logprobs=cfg.logprobs if cfg.logprobs > 0 else None,
  )


def format_layout(cfg: ml_collections.FrozenConfigDict) -> str:
  """Each layer's kind, KV-cache group, physical slot, cache shapes/dtypes/bytes, and the total memory; the
  parameters' bytes beside them; then what the cache holds for requests of `max_target_length` tokens with the
  hybrid allocator on and off."""
  specs, shared = kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg)
  layout = make_kv_cache_manager(cfg).format_layout()
  capacity = kv_cache_capacity.format_capacity(*kv_cache_capacity.compare(cfg, specs, shared))
  return "\n".join([layout, memory_budget.format_need(cfg, memory_budget.memory_need(cfg)), capacity])


def _logprobs_json(output: Any, num_top: int) -> list[dict[str, Any]]:
  """Per token: its id and log-probability and the `num_top` most likely `[id, log-probability]` pairs (the most
  likely first, lower id first on ties)."""
  if output.logprobs is None:
    return []
  out = []
  for token, position in zip(output.token_ids, output.logprobs):
    top = sorted(position.items(), key=lambda item: (-item[1].logprob, item[0]))[:num_top]
    out.append({"token_id": token, "logprob": position[token].logprob, "top": [[t, lp.logprob] for t, lp in top]})
  return out


def outputs_to_json(outputs: Sequence[RequestOutput], stats: dict[str, Any], num_top_logprobs: int = 0) -> str:
  """The CLI's JSON document (`num_top_logprobs`: the `logprobs` key, how many most likely tokens each holds)."""
  requests = []
  for out in outputs:
    completion = out.outputs[0]
    requests.append(
        {
            "prompt_token_ids": list(out.prompt_token_ids),
            "output_token_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "logprobs": _logprobs_json(completion, num_top_logprobs),
        }
    )
  return json.dumps({"requests": requests, "stats": stats})


def run(argv: Sequence[str], cancel: threading.Event | None = None) -> int:
  """Runs the CLI on `argv` (without the program name); returns the exit status. Setting `cancel` stops the
  generation before its next step (KeyboardInterrupt, its requests aborted)."""
  args = list(argv)
  config_path = args.pop(0) if args and "=" not in args[0] else None
  cfg = load_run_config(([config_path] if config_path else []) + args)
  if cfg.dry_run:
    print(format_layout(cfg))
    return 0
  prompts = cli_prompts(cfg)  # a malformed prompts_file fails here, before the model is built
  llm = LLM(config=cfg)
  params = sampling_params_from_config(cfg)
  report_length_cap(cfg, llm, prompts, params)
  if cfg.output_format == "json":
    outputs = llm.generate([p.prompt for p in prompts], params, use_tqdm=True, cancel=cancel)
    print(outputs_to_json(outputs, llm.engine.stats.as_dict(), cfg.logprobs))
  elif len(prompts) == 1 and not cfg.prompts_file:
    outputs = generate_streaming(llm, prompts[0].prompt, params, cancel)
    report_cut_answers(cfg, outputs)
  else:
    watch = ReaderWatch(sys.stdout)
    outputs = print_completions(
        prompts,
        llm.generate_iter([p.prompt for p in prompts], params, use_tqdm=True, on_token=watch.on_token, cancel=cancel),
    )
    report_cut_answers(cfg, outputs)
  return 0


def cli_prompts(cfg: ml_collections.FrozenConfigDict) -> list[FilePrompt]:
  """The prompts of a run: `prompts_file`'s (checked whole), else `prompt_token_ids`, else `prompt` (line 0).

  Raises:
    ValueError: an empty prompt, `prompt` text that is not valid UTF-8 (naming the key), prompts_file together
      with prompt_token_ids, or a malformed prompts_file line.
  """
  if cfg.prompts_file:
    if cfg.prompt_token_ids:
      raise ValueError("prompts_file and prompt_token_ids are both set; set one")
    return read_prompts_file(cfg.prompts_file)
  if cfg.prompt_token_ids:
    return [FilePrompt(0, list(cfg.prompt_token_ids))]
  if not cfg.prompt:
    raise ValueError("prompt is empty: set prompt=... or prompt_token_ids=[...]")
  prompt_checks.check_text(cfg.prompt, "prompt")
  return [FilePrompt(0, cfg.prompt)]


def generate_streaming(
    llm: LLM, prompt: Any, params: SamplingParams, cancel: threading.Event | None = None
) -> list[RequestOutput]:
  """Generates one completion, writing its text to stdout token by token (no progress bar)."""
  streamer = TextStreamer(llm.tokenizer.decode, sys.stdout)
  outputs = llm.generate([prompt], params, use_tqdm=False, on_token=streamer.on_token, cancel=cancel)
  streamer.finish()
  return outputs


def print_completions(prompts: Sequence[FilePrompt], outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
  """Each completion after a `=== prompt K (line N) ===` header, in input order, written and flushed as soon as
  `outputs` (e.g. `LLM.generate_iter`) hands it out; returns the outputs."""
  printed = []
  for k, out in enumerate(outputs):
    sys.stdout.write(f"=== prompt {k} (line {prompts[k].line}) ===\n{out.outputs[0].text}\n")
    sys.stdout.flush()
    printed.append(out)
  return printed


class ReaderWatch:
  """Notices between decode steps that the reader of a pipe went away (`maxtext-decode ... | head -2` exited),
  so a run whose later completions nobody will read stops then, instead of at its next write.

  Args:
    stream: the text stream written to (sys.stdout); a stream without a descriptor (captured output) or a platform
      without `select.poll` is never reported gone.
  """

  def __init__(self, stream: Any):
    self._poll = None
    try:
      poll = select.poll()
      poll.register(stream.fileno(), 0)  # no event asked for: poll still reports POLLERR once a pipe's reader closed
    except (AttributeError, OSError, ValueError):
      return
    self._poll = poll

  def on_token(self, index: int, token_id: int) -> None:
    """`LLM.generate`'s `on_token` callback.

    Raises:
      BrokenPipeError: the reader of the stream is gone.
    """
    del index, token_id
    if self._poll is not None and any(event & (select.POLLERR | select.POLLHUP) for _, event in self._poll.poll(0)):
      raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")


def report_length_cap(
    cfg: ml_collections.FrozenConfigDict, llm: LLM, prompts: Sequence[FilePrompt], params: SamplingParams
) -> None:
  """One stderr line, before decoding, when max_target_length leaves fewer than max_new_tokens after a prompt.

  Generation stops at max_target_length anyway (finish reason "length", the API's documented rule); the CLI says
  so once instead of letting a progress bar promise tokens that will never be generated. Prompt lengths are those
  of the ids the model receives (after the chat template when `use_chat_template=true`).
  """
  limit, wanted = cfg.max_target_length, params.max_tokens
  if not cfg.max_new_tokens:
    return  # no cap asked for: generating until max_target_length is the rule, not a surprise
  lengths = [len(llm.prompt_token_ids(p.prompt)) for p in prompts]
  reachable = [prompt_checks.num_generatable_tokens(n, wanted, limit) for n in lengths]
  capped = sorted((r, n) for r, n in zip(reachable, lengths) if 1 <= r < wanted)  # r < 1: the scheduler says it
  if not capped:
    return
  fewest, length = capped[0]
  if len(prompts) == 1:
    detail = f"leaves room for {fewest} tokens after the {length}-token prompt; generating at most {fewest}"
  else:
    detail = (
        f"leaves room for fewer tokens after {len(capped)} of {len(prompts)} prompts (as few as {fewest} after a"
        f" {length}-token prompt); each generates at most what fits"
    )
  print(f"maxtext-decode: warning: max_new_tokens={wanted} but max_target_length={limit} {detail}", file=sys.stderr)


def report_cut_answers(cfg: ml_collections.FrozenConfigDict, outputs: Sequence[RequestOutput]) -> None:
  """One stderr line, after text output, when an answer stopped at a length limit without reaching eos.

  With max_new_tokens set, it names the answers that stopped at that cap (those that max_target_length stopped
  were announced before decoding, by `report_length_cap`). With max_new_tokens=0 a length stop can only be
  max_target_length, which is then named. JSON output says the same per request in `finish_reason`.
  """
  cut = [out for out in outputs if out.outputs[0].finish_reason == "length"]
  if cfg.max_new_tokens:
    cut = [out for out in cut if len(out.outputs[0].token_ids) >= cfg.max_new_tokens]
    limit = f"max_new_tokens={cfg.max_new_tokens}"
    advice = f"raise it, or set it to 0 (the default) to stop only at eos or max_target_length={cfg.max_target_length}"
  else:
    limit = f"max_target_length={cfg.max_target_length} (prompt + answer)"
    advice = "raise max_target_length"
  if not cut:
    return
  which = "the answer" if len(outputs) == 1 else f"{len(cut)} of {len(outputs)} answers"
  print(f"maxtext-decode: warning: {which} stopped at {limit} without reaching eos; {advice}", file=sys.stderr)
