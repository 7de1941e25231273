"""Benchmark: the hybrid allocator end to end, on and off, in the same KV-cache bytes.

Two models at test-size widths with real layer patterns:
  gemma3   12 layers, 5 sliding (window 128) : 1 full attention (6 KV-cache groups of 2 layers, 2 arrays)
  qwen3_5  8 layers, 3 Gated DeltaNet : 1 full attention (no sliding layer: the allocator changes nothing)
For each context length C it runs the engine on `--requests` greedy requests of `C - --new-tokens` prompt tokens
that generate `--new-tokens` tokens each (so every request reaches C tokens), with `max_num_seqs` = the request
count and `max_target_length` = C, so only the cache limits how many run at once. The cache is a fixed number of
bytes per model (`kv_cache_memory_bytes`); `hybrid_kv_cache=true` and `false` each get as many blocks as those
bytes hold in their layout. It reports, side by side:
  admitted    the most requests a step ran together (the engine's `peak_running_requests`)
  preempt     preemptions
  tok/s       generated tokens per second of wall time over the steps that compiled nothing (the first steps of
              each shape compile; their time and tokens are left out of both modes alike)
  same        whether the greedy tokens of both modes are identical
and the ratios on / off. Timings are measurements only; nothing is asserted.

Usage: python scripts/benchmark_allocator.py [--models gemma3 qwen3_5] [--contexts 1024 2048 4096 8192]
                                             [--requests 24] [--new-tokens 256] [--plot PATH.png] [--quick] [--json]
"""

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

from support.benchmark_cli import add_output_flags, emit, positive_int, pyplot
from maxtext.checkpoint import load_run_config
from maxtext.inference import SamplingParams
from maxtext.inference.engine import LLMEngine

CONTEXTS = (1024, 2048, 4096, 8192)
MIB = 2**20
# name -> (config overrides, KV-cache MiB). Gemma3's cache holds 4 requests of 4,096 tokens with the allocator off
# (12 arrays x 32 KiB a block); Qwen3.5's the same (2 attention arrays x 32 KiB, plus the recurrent state slots).
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "gemma3": (
        {
            "model_name": "gemma3-tiny",
            "base_num_decoder_layers": 12,
            "inhomogeneous_layer_cycle_interval": 6,
            "sliding_window_size": 128,
        },
        400,
    ),
    "qwen3_5": ({"model_name": "qwen3.5-tiny"}, 70),
}
QUICK = {"contexts": (256,), "requests": 6, "new_tokens": 8, "window": 32, "mib": {"gemma3": 20, "qwen3_5": 6}}


def config_overrides(
    name: str, *, hybrid: bool, context: int, cache_bytes: int, requests: int, chunk: int, window: int | None = None
) -> dict[str, Any]:
  """The `LLM` keys of one run."""
  overrides = dict(MODELS[name][0])
  if window is not None and "sliding_window_size" in overrides:
    overrides["sliding_window_size"] = window
  return dict(
      overrides,
      hybrid_kv_cache=hybrid,
      block_size=16,
      kv_cache_memory_bytes=cache_bytes,
      max_target_length=context,
      max_num_seqs=requests,
      max_num_batched_tokens=chunk,
  )


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
  """Distinct deterministic prompts (no shared prefix) of token ids in [3, vocab_size).

  Raises:
    ValueError: a count or length below 1, or a vocabulary of 3 ids or fewer.
  """
  if num_requests < 1 or prompt_len < 1 or vocab_size <= 3:
    raise ValueError(
        f"need num_requests >= 1, prompt_len >= 1 and vocab_size > 3; got {num_requests}, {prompt_len}, {vocab_size}"
    )
  span = vocab_size - 3
  return [[3 + (i * 7919 + j * (2 * i + 3)) % span for j in range(prompt_len)] for i in range(num_requests)]


def run_engine(overrides: dict[str, Any], prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
  """Runs the requests to completion step by step (no end-of-sequence token: every request generates `new_tokens`);
  returns tokens, admitted, preemptions and timings."""
  engine = LLMEngine(load_run_config(**overrides))
  params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
  ids = [engine.add_request(list(p), params) for p in prompts]
  outputs: dict[str, tuple[int, ...]] = {}
  timed_s, timed_tokens, compiled_steps = 0.0, 0, 0
  while engine.has_unfinished_requests():
    traces, generated = engine.stats.step_traces, engine.stats.generated_tokens
    start = time.perf_counter()
    for finished in engine.step():
      outputs[finished.request_id] = finished.output_token_ids
    elapsed = time.perf_counter() - start
    if engine.stats.step_traces == traces:
      timed_s += elapsed
      timed_tokens += engine.stats.generated_tokens - generated
    else:
      compiled_steps += 1
  stats = engine.stats
  return {
      "tokens": [list(outputs[rid]) for rid in ids],
      "admitted": stats.peak_running_requests,
      "preemptions": stats.preemptions,
      "num_blocks": engine.manager.num_blocks,
      "peak_kv_blocks": stats.peak_kv_blocks,
      "generated_tokens": stats.generated_tokens,
      "wall_s": stats.wall_time_s,
      "compiled_steps": compiled_steps,
      "tokens_per_s": timed_tokens / timed_s if timed_s > 0 else 0.0,
  }


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
  """The on / off ratios and whether the tokens agree."""
  return {
      "same_tokens": on["tokens"] == off["tokens"],
      "admitted_ratio": on["admitted"] / off["admitted"] if off["admitted"] else float("inf"),
      "tokens_per_s_ratio": on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else float("inf"),
  }


def measure(name: str, context: int, args: argparse.Namespace) -> dict[str, Any]:
  """Both modes of one (model, context) case."""
  row: dict[str, Any] = {"model": name, "context": context, "cache_bytes": args.cache_mib[name] * MIB}
  prompt_len = context - args.new_tokens
  for hybrid in (True, False):
    overrides = config_overrides(
        name,
        hybrid=hybrid,
        context=context,
        cache_bytes=row["cache_bytes"],
        requests=args.requests,
        chunk=args.chunk,
        window=args.window,
    )
    prompts = make_prompts(args.requests, prompt_len, 512)
    row["on" if hybrid else "off"] = run_engine(overrides, prompts, args.new_tokens)
  row.update(compare(row["on"], row["off"]))
  for key in ("on", "off"):
    del row[key]["tokens"]  # compared above; too long for the report
  return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` results (on / off side by side)."""
  header = (
      f"{'model':<8} {'context':>7} {'MiB':>4} {'blocks on/off':>13} {'admitted on/off':>15} {'ratio':>5} "
      f"{'preempt on/off':>14} {'tok/s on/off':>13} {'ratio':>5} {'same':>4}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    on, off = row["on"], row["off"]
    lines.append(
        f"{row['model']:<8} {row['context']:>7} {row['cache_bytes'] // MIB:>4} "
        f"{on['num_blocks']:>6}/{off['num_blocks']:<6} {on['admitted']:>7}/{off['admitted']:<7} "
        f"{row['admitted_ratio']:>5.2f} {on['preemptions']:>6}/{off['preemptions']:<7} "
        f"{on['tokens_per_s']:>6.0f}/{off['tokens_per_s']:<6.0f} {row['tokens_per_s_ratio']:>5.2f} "
        f"{'yes' if row['same_tokens'] else 'NO':>4}"
    )
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> str:
  """Writes admitted requests and tokens/s against context, per model, on and off; returns a message."""
  plt, skipped = pyplot(path)
  if plt is None:
    return skipped
  fig, (admitted, speed) = plt.subplots(1, 2, figsize=(10, 4))
  for name in dict.fromkeys(row["model"] for row in rows):
    mine = [row for row in rows if row["model"] == name]
    contexts = [row["context"] for row in mine]
    for key, style in (("on", "-o"), ("off", "--s")):
      label = f"{name} hybrid {key}"
      admitted.plot(contexts, [row[key]["admitted"] for row in mine], style, label=label)
      speed.plot(contexts, [row[key]["tokens_per_s"] for row in mine], style, label=label)
  for ax, ylabel in ((admitted, "requests running at once (peak)"), (speed, "generated tokens / s")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("hybrid_kv_cache on vs off, the same KV-cache bytes")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f"wrote {path}"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", choices=tuple(MODELS), nargs="+", default=list(MODELS), help="models to run")
  parser.add_argument("--contexts", type=positive_int, nargs="+", default=None, help="request lengths (tokens)")
  parser.add_argument("--requests", type=positive_int, default=None, help="requests per run (24)")
  parser.add_argument("--new-tokens", type=positive_int, default=None, help="greedy tokens per request (256)")
  parser.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk (max_num_batched_tokens)")
  parser.add_argument("--cache-mib", type=positive_int, default=None, help="KV-cache MiB for every model")
  parser.add_argument("--plot", default="", help="write a PNG of admitted requests and tok/s vs context")
  add_output_flags(parser, f"context {QUICK['contexts']}, {QUICK['requests']} requests, window {QUICK['window']}")
  args = parser.parse_args(argv)
  args.window = QUICK["window"] if args.quick else None
  if args.contexts is None:
    args.contexts = list(QUICK["contexts"] if args.quick else CONTEXTS)
  if args.requests is None:
    args.requests = QUICK["requests"] if args.quick else 24
  if args.new_tokens is None:
    args.new_tokens = QUICK["new_tokens"] if args.quick else 256
  mib = dict(QUICK["mib"]) if args.quick else {name: model_mib for name, (_, model_mib) in MODELS.items()}
  args.cache_mib = {name: args.cache_mib or mib[name] for name in MODELS}
  if min(args.contexts) <= args.new_tokens:
    parser.error(f"--contexts must exceed --new-tokens ({args.new_tokens}); got {min(args.contexts)}")

  rows = [measure(name, context, args) for name in args.models for context in args.contexts]
  message = plot(rows, args.plot) if args.plot else ""
  settings = {k: getattr(args, k) for k in ("requests", "new_tokens", "chunk", "cache_mib", "quick")}
  header = (
      f"{args.requests} greedy requests of context - {args.new_tokens} prompt tokens + {args.new_tokens} generated,"
      f" block_size 16, prefill chunk {args.chunk}; on/off = hybrid_kv_cache true/false in the same bytes"
  )
  lines = [header, format_table(rows)] + ([message] if message else [])
  emit(args.json, {"settings": settings, "results": rows, "plot": message}, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
