"""`maxtext-decode` / `python -m maxtext.decode`: run a decode from a YAML config and `key=value` overrides.

    maxtext-decode configs/base.yml model_name=qwen3-next-tiny prompt="I love to" max_new_tokens=16
    maxtext-decode configs/base.yml model_name=qwen3-next-tiny output_format=json
    maxtext-decode configs/base.yml model_name=qwen3.5-tiny dry_run=true      # the cache layout, no model run
    maxtext-decode configs/base.yml model_name=smollm2-135m-instruct prompt="What is the capital of France?" \
        use_chat_template=true                                                 # a real model (fetch it first)
    maxtext-decode configs/base.yml model_name=llama-tiny prompts_file=prompts.jsonl output_format=json

Text output streams the completion of a single prompt to stdout as it is generated; with `prompts_file=` (one
prompt per line, or JSON Lines with "prompt" or "prompt_token_ids") all prompts are decoded together and each
completion is printed after a `=== prompt K (line N) ===` header, in file order. `output_format=json` prints
exactly one JSON object on stdout:
`{"requests": [{"prompt_token_ids", "output_token_ids", "text", "logprobs"}], "stats": {...}}`. Logs and progress
go to stderr. Bad input (unknown key, bad value, missing file) prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from maxtext.checkpoint import load_run_config
from maxtext.inference.engine import make_kv_cache_manager
from maxtext.inference.llm import LLM, RequestOutput
from maxtext.inference.prompts_file import FilePrompt, read_prompts_file
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import RequestNeverFitsError
from maxtext.inference.streaming import TextStreamer

USAGE = "usage: maxtext-decode [configs/base.yml] key=value ...  (see configs/base.yml for every key)"
# Errors that mean "the input is wrong", reported as one line with exit status 2. Anything else is a bug: traceback.
# RequestNeverFitsError: the configured cache pools (num_kv_blocks, block_size) are too small for the request.
USER_ERRORS = (ValueError, TypeError, NotImplementedError, FileNotFoundError, KeyError, RequestNeverFitsError)


def sampling_params_from_config(cfg: ml_collections.FrozenConfigDict) -> SamplingParams:
  """The decode keys as SamplingParams (MaxText conventions: top_k <= 0 and top_p <= 0 mean "off")."""
  return SamplingParams(
      max_tokens=cfg.max_new_tokens,
      temperature=cfg.decode_sampling_temperature,
      top_k=cfg.decode_sampling_top_k if cfg.decode_sampling_top_k > 0 else -1,
      top_p=cfg.decode_sampling_nucleus_p if cfg.decode_sampling_nucleus_p > 0 else 1.0,
      seed=cfg.seed,
      logprobs=cfg.logprobs if cfg.logprobs > 0 else None,
  )


def format_layout(cfg: ml_collections.FrozenConfigDict) -> str:
  """Each layer's kind, KV-cache group, physical slot, cache shapes/dtypes/bytes, and the total memory."""
  return make_kv_cache_manager(cfg).format_layout()


def _logprobs_json(output: Any) -> list[dict[str, Any]]:
  if output.logprobs is None:
    return []
  return [
      {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[tid, value] for tid, value in lp.top]}
      for lp in output.logprobs
  ]


def outputs_to_json(outputs: Sequence[RequestOutput], stats: dict[str, Any]) -> str:
  """The CLI's JSON document."""
  requests = []
  for out in outputs:
    completion = out.outputs[0]
    requests.append(
        {
            "prompt_token_ids": list(out.prompt_token_ids),
            "output_token_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "logprobs": _logprobs_json(completion),
        }
    )
  return json.dumps({"requests": requests, "stats": stats})


def run(argv: Sequence[str]) -> int:
  """Runs the CLI on `argv` (without the program name); returns the exit status."""
  args = list(argv)
  config_path = args.pop(0) if args and "=" not in args[0] else None
  cfg = load_run_config(([config_path] if config_path else []) + args)
  if cfg.dry_run:
    print(format_layout(cfg))
    return 0
  prompts = cli_prompts(cfg)  # a malformed prompts_file fails here, before the model is built
  llm = LLM(config=cfg)
  params = sampling_params_from_config(cfg)
  if cfg.output_format == "json":
    outputs = llm.generate([p.prompt for p in prompts], params, use_tqdm=True)
    print(outputs_to_json(outputs, llm.engine.stats.as_dict()))
  elif len(prompts) == 1 and not cfg.prompts_file:
    outputs = generate_streaming(llm, prompts[0].prompt, params)
  else:
    outputs = llm.generate([p.prompt for p in prompts], params, use_tqdm=True)
    print_completions(prompts, outputs)
  report_length_cap(cfg, outputs)
  return 0


def cli_prompts(cfg: ml_collections.FrozenConfigDict) -> list[FilePrompt]:
  """The prompts of a run: `prompts_file`'s (checked whole), else `prompt_token_ids`, else `prompt` (line 0).

  Raises:
    ValueError: an empty prompt, prompts_file together with prompt_token_ids, or a malformed prompts_file line.
  """
  if cfg.prompts_file:
    if cfg.prompt_token_ids:
      raise ValueError("prompts_file and prompt_token_ids are both set; set one")
    return read_prompts_file(cfg.prompts_file)
  prompt: Any = list(cfg.prompt_token_ids) if cfg.prompt_token_ids else cfg.prompt
  if not prompt:
    raise ValueError("prompt is empty: set prompt=... or prompt_token_ids=[...]")
  return [FilePrompt(0, prompt)]


def generate_streaming(llm: LLM, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
  """Generates one completion, writing its text to stdout token by token (no progress bar)."""
  streamer = TextStreamer(llm.tokenizer.decode, sys.stdout)
  outputs = llm.generate([prompt], params, on_token=streamer.on_token)
  streamer.finish()
  return outputs


def print_completions(prompts: Sequence[FilePrompt], outputs: Sequence[RequestOutput]) -> None:
  """Each completion after a `=== prompt K (line N) ===` header, in input order."""
  for k, (prompt, out) in enumerate(zip(prompts, outputs)):
    print(f"=== prompt {k} (line {prompt.line}) ===")
    print(out.outputs[0].text)


def report_length_cap(cfg: ml_collections.FrozenConfigDict, outputs: Sequence[RequestOutput]) -> None:
  """One stderr line when max_target_length stopped a generation before max_new_tokens tokens."""
  capped = [
      out
      for out in outputs
      if out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) < cfg.max_new_tokens
  ]
  if not capped:
    return
  shortest = min(len(out.outputs[0].token_ids) for out in capped)
  print(
      f"maxtext-decode: warning: max_new_tokens={cfg.max_new_tokens} is more than max_target_length="
      f"{cfg.max_target_length} leaves after the prompt for {len(capped)} of {len(outputs)} prompts (as few as"
      f" {shortest} tokens were generated); raise max_target_length to generate more",
      file=sys.stderr,
  )


def main(argv: Sequence[str] | None = None) -> int:
  """Console entry point: user errors become one line on stderr and exit status 2."""
  args = sys.argv[1:] if argv is None else list(argv)
  if args and args[0] in ("-h", "--help"):
    print(USAGE)
    print(__doc__)
    return 0
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
  try:
    return run(args)
  except USER_ERRORS as e:
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"maxtext-decode: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
