"""`maxtext-decode` / `python -m maxtext.decode`: run a decode from a YAML config and `key=value` overrides.

    maxtext-decode configs/base.yml model_name=qwen3-next-tiny prompt="I love to" max_new_tokens=16
    maxtext-decode configs/base.yml model_name=qwen3-next-tiny output_format=json
    maxtext-decode configs/base.yml model_name=qwen3.5-tiny dry_run=true      # the cache layout, no model run

Text output prints the completion on stdout; `output_format=json` prints exactly one JSON object on stdout:
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
from maxtext.inference.sampling_params import SamplingParams
from maxtext.inference.scheduler import RequestNeverFitsError
from maxtext.integration.vllm.environment import PluginEnvironmentError

USAGE = "usage: maxtext-decode [configs/base.yml] key=value ...  (see configs/base.yml for every key)"
# Errors that mean "the input is wrong", reported as one line with exit status 2. Anything else is a bug: traceback.
# RequestNeverFitsError: the configured cache pools (num_kv_blocks, block_size) are too small for the request.
USER_ERRORS = (
    ValueError,
    TypeError,
    NotImplementedError,
    FileNotFoundError,
    KeyError,
    RequestNeverFitsError,
    PluginEnvironmentError,  # e.g. kernel_backend=tpu_inference without tpu-inference installed
)


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
  llm = LLM(config=cfg)
  prompt: Any = list(cfg.prompt_token_ids) if cfg.prompt_token_ids else cfg.prompt
  if not prompt:
    raise ValueError("prompt is empty: set prompt=... or prompt_token_ids=[...]")
  outputs = llm.generate([prompt], sampling_params_from_config(cfg), use_tqdm=True)
  if cfg.output_format == "json":
    print(outputs_to_json(outputs, llm.engine.stats.as_dict()))
  else:
    for out in outputs:
      print(out.outputs[0].text)
  return 0


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
