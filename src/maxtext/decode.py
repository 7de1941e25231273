"""`maxtext-decode` / `python -m maxtext.decode`: run a decode from a YAML config and `key=value` overrides.

    maxtext-decode configs/base.yml model_name=qwen3-next-tiny prompt="I love to" max_new_tokens=16
    maxtext-decode configs/base.yml model_name=qwen3-next-tiny output_format=json
    maxtext-decode configs/base.yml model_name=qwen3.5-tiny dry_run=true      # the cache layout, no model run

Text output prints the completion on stdout; `output_format=json` prints exactly one JSON object on stdout:
`{"requests": [{"prompt_token_ids", "output_token_ids", "text", "finish_reason", "logprobs"}], "stats": {...}}`
(finish_reason: "stop" at eos or a stop token, "length" at max_new_tokens or max_target_length). Logs and progress
go to stderr. Bad input (unknown key, bad value, missing file) prints one line on stderr and exits with status 2;
Ctrl-C exits with status 130.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from maxtext.checkpoint import load_run_config
from maxtext.inference.engine import make_kv_cache_manager
from maxtext.inference import prompts as prompt_checks
from maxtext.inference.llm import LLM, RequestOutput
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import RequestNeverFitsError

USAGE = "usage: maxtext-decode [configs/base.yml] key=value ...  (see configs/base.yml for every key)"
# Errors that mean "the input is wrong", reported as one line with exit status 2. Anything else is a bug: traceback.
# RequestNeverFitsError: the configured cache pools (num_kv_blocks, block_size) are too small for the request.
# OSError: a path that cannot be read (missing, a folder where a file is expected, no permission).
USER_ERRORS = (ValueError, TypeError, NotImplementedError, OSError, KeyError, RequestNeverFitsError)
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 1  # the reader of stdout went away (`maxtext-decode --help | head -1`)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


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


def prompt_from_config(cfg: ml_collections.FrozenConfigDict) -> str | list[int]:
  """The CLI's prompt: `prompt_token_ids` when set, else `prompt` (checked like the API's, named by the key).

  Raises:
    ValueError: both are empty, or `prompt` is not valid UTF-8 text (naming the key).
  """
  if cfg.prompt_token_ids:
    return list(cfg.prompt_token_ids)
  if not cfg.prompt:
    raise ValueError("prompt is empty: set prompt=... or prompt_token_ids=[...]")
  prompt_checks.check_text(cfg.prompt, "prompt")
  return cfg.prompt


def cap_max_new_tokens(
    cfg: ml_collections.FrozenConfigDict, params: SamplingParams, num_prompt_tokens: int
) -> SamplingParams:
  """`params` with max_tokens lowered to what max_target_length leaves after the prompt, saying so on stderr.

  Generation stops at max_target_length anyway (the API's documented rule, finish reason "length"); the CLI says
  so in one line instead of silently showing a progress bar for tokens that will never be generated.

  Args:
    cfg: the loaded config (max_target_length).
    params: the sampling params from `sampling_params_from_config`.
    num_prompt_tokens: the prompt's length in tokens (bos included).
  """
  reachable = prompt_checks.num_generatable_tokens(num_prompt_tokens, params.max_tokens, cfg.max_target_length)
  if reachable >= params.max_tokens or reachable < 1:  # < 1: the scheduler reports the too-long prompt
    return params
  print(
      f"maxtext-decode: warning: max_new_tokens={params.max_tokens} but max_target_length={cfg.max_target_length}"
      f" leaves room for {reachable} tokens after the {num_prompt_tokens}-token prompt; generating at most"
      f" {reachable}",
      file=sys.stderr,
  )
  return dataclasses.replace(params, max_tokens=reachable)


def run(argv: Sequence[str]) -> int:
  """Runs the CLI on `argv` (without the program name); returns the exit status."""
  args = list(argv)
  config_path = args.pop(0) if args and "=" not in args[0] else None
  cfg = load_run_config(([config_path] if config_path else []) + args)
  if cfg.dry_run:
    print(format_layout(cfg))
    return 0
  prompt = prompt_from_config(cfg)
  llm = LLM(config=cfg)
  params = sampling_params_from_config(cfg)
  num_prompt_tokens = len(prompt) if isinstance(prompt, list) else len(llm.tokenizer.encode(prompt, add_bos=True))
  params = cap_max_new_tokens(cfg, params, num_prompt_tokens)
  outputs = llm.generate([prompt], params, use_tqdm=True)
  if cfg.output_format == "json":
    print(outputs_to_json(outputs, llm.engine.stats.as_dict()))
  else:
    for out in outputs:
      print(out.outputs[0].text)
  return 0


def _print_usage() -> int:
  print(USAGE)
  print(__doc__)
  return 0


def _silence_stdout() -> None:
  """Points stdout at /dev/null, so the interpreter's final flush cannot raise BrokenPipeError again."""
  try:
    fileno = sys.stdout.fileno()
  except (OSError, ValueError, AttributeError):  # a replaced stdout (e.g. captured) has no descriptor to redirect
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, fileno)
  os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
  """Console entry point: user errors become one line on stderr and exit status 2; Ctrl-C exits 130."""
  args = sys.argv[1:] if argv is None else list(argv)
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
  try:
    status = _print_usage() if args and args[0] in ("-h", "--help") else run(args)
    sys.stdout.flush()  # a closed pipe raises here, inside the handler, rather than at interpreter exit
    return status
  except USER_ERRORS as e:
    if isinstance(e, BrokenPipeError):
      _silence_stdout()
      return EXIT_BROKEN_PIPE
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"maxtext-decode: error: {message}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    print("maxtext-decode: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
  sys.exit(main())
