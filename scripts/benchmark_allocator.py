"""Benchmark: the hybrid allocator end to end, on and off, in the same KV-cache bytes, over the scheduler's settings.

Two models at test-size widths with real layer patterns:
  gemma3   12 layers, 5 sliding (window 128) : 1 full attention (6 KV-cache groups of 2 layers, 2 arrays)
  qwen3_5  8 layers, 3 Gated DeltaNet : 1 full attention (no sliding layer: the allocator changes nothing)
It sweeps context C x `max_num_batched_tokens` (`--chunks`) x `max_num_seqs` (`--max-num-seqs`) x
`admission_reserve`. Each cell runs the engine on `--requests` greedy requests of `C - --new-tokens` prompt tokens
that generate `--new-tokens` tokens each (so every request reaches C tokens), with `max_target_length` = C and
prefix caching on (`--prefix-caching`), so a preempted request resumes from its blocks still cached. The cache is a
fixed number of bytes per model (`kv_cache_memory_bytes`); `hybrid_kv_cache=true` and `false` each get as many
blocks as those bytes hold in their layout. It reports, side by side:
  admitted    the most requests a step ran together (the engine's `peak_running_requests`)
  preempt     preemptions
  recomp      tokens computed again after a preemption (the engine's `recomputed_tokens`)
  steps       model steps (where a step costs the same however many requests it holds, time follows steps; on a
              CPU the kernels' work grows with the tokens a step holds, so tok/s moves much less than steps)
  tok/s       generated tokens per second of wall time over the steps that compiled nothing (the first steps of
              each shape compile; their time and tokens are left out of both modes alike)
  same        whether the greedy tokens of both modes are identical
and the ratios on / off. Timings are measurements only; nothing is asserted.

Usage: python scripts/benchmark_allocator.py [--models gemma3 qwen3_5] [--contexts 2048 4096 8192]
                                             [--chunks 512 2048] [--max-num-seqs 24 64]
                                             [--admission-reserve none max_tokens] [--prefix-caching on|off]
                                             [--requests 64] [--new-tokens 256] [--plot PATH.png] [--quick] [--json]
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

CONTEXTS = (2048, 4096, 8192)
CHUNKS = (512, 2048)  # max_num_batched_tokens
MAX_NUM_SEQS = (24, 64)
RESERVES = ("none", "max_tokens")  # admission_reserve
REQUESTS = 64  # as many as the largest max_num_seqs, so that it can matter
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
QUICK = {
    "contexts": (256,),
    "chunks": (512,),
    "max_num_seqs": (6,),
    "requests": 6,
    "new_tokens": 8,
    "window": 32,
    "mib": {"gemma3": 20, "qwen3_5": 6},
}


def config_overrides(
    name: str,
    *,
    hybrid: bool,
    context: int,
    cache_bytes: int,
    max_num_seqs: int,
    chunk: int,
    reserve: str = "none",
    prefix_caching: bool = True,
    window: int | None = None,
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
      max_num_seqs=max_num_seqs,
      max_num_batched_tokens=chunk,
      admission_reserve=reserve,
      enable_prefix_caching=prefix_caching,
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
  returns tokens, admitted, preemptions, recomputed tokens and timings."""
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
      "recomputed_tokens": stats.recomputed_tokens,
      "steps": stats.steps,
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


def cells(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The sweep's cells in report order: model, then context, chunk, max_num_seqs, admission_reserve."""
  return [
      {"model": name, "context": context, "chunk": chunk, "max_num_seqs": seqs, "reserve": reserve}
      for name in args.models
      for context in args.contexts
      for chunk in args.chunks
      for seqs in args.max_num_seqs
      for reserve in args.admission_reserve
  ]


def measure(cell: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
  """Both modes of one cell."""
  name = cell["model"]
  row: dict[str, Any] = dict(cell, cache_bytes=args.cache_mib[name] * MIB)
  prompts = make_prompts(args.requests, cell["context"] - args.new_tokens, 512)
  for hybrid in (True, False):
    overrides = config_overrides(
        name,
        hybrid=hybrid,
        context=cell["context"],
        cache_bytes=row["cache_bytes"],
        max_num_seqs=cell["max_num_seqs"],
        chunk=cell["chunk"],
        reserve=cell["reserve"],
        prefix_caching=args.prefix_caching == "on",
        window=args.window,
    )
    row["on" if hybrid else "off"] = run_engine(overrides, prompts, args.new_tokens)
  row.update(compare(row["on"], row["off"]))
  for key in ("on", "off"):
    del row[key]["tokens"]  # compared above; too long for the report
  return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` results (on / off side by side)."""
  header = (
      f"{'model':<8} {'context':>7} {'chunk':>5} {'seqs':>4} {'reserve':<10} {'MiB':>4} {'blocks on/off':>13} "
      f"{'admitted on/off':>15} {'ratio':>5} {'preempt on/off':>14} {'recomp on/off':>17} {'steps on/off':>13} "
      f"{'tok/s on/off':>13} "
      f"{'ratio':>5} {'same':>4}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    on, off = row["on"], row["off"]
    lines.append(
        f"{row['model']:<8} {row['context']:>7} {row['chunk']:>5} {row['max_num_seqs']:>4} {row['reserve']:<10} "
        f"{row['cache_bytes'] // MIB:>4} {on['num_blocks']:>6}/{off['num_blocks']:<6} "
        f"{on['admitted']:>7}/{off['admitted']:<7} {row['admitted_ratio']:>5.2f} "
        f"{on['preemptions']:>6}/{off['preemptions']:<7} "
        f"{on['recomputed_tokens']:>8}/{off['recomputed_tokens']:<8} "
        f"{on['steps']:>6}/{off['steps']:<6} "
        f"{on['tokens_per_s']:>6.0f}/{off['tokens_per_s']:<6.0f} {row['tokens_per_s_ratio']:>5.2f} "
        f"{'yes' if row['same_tokens'] else 'NO':>4}"
    )
  return "\n".join(lines)


def _series_label(row: dict[str, Any]) -> str:
  return f"{row['model']} chunk {row['chunk']} seqs {row['max_num_seqs']} reserve {row['reserve']}"


def plot(rows: Sequence[dict[str, Any]], path: str) -> str:
  """Writes the tok/s ratio on / off, tok/s and recomputed tokens against context, one line per setting of the
  other axes (allocator on: solid, off: dashed); returns a message."""
  plt, skipped = pyplot(path)
  if plt is None:
    return skipped
  fig, (ratio, speed, recomputed) = plt.subplots(1, 3, figsize=(16, 5))
  for label in dict.fromkeys(_series_label(row) for row in rows):
    mine = [row for row in rows if _series_label(row) == label]
    contexts = [row["context"] for row in mine]
    line = ratio.plot(contexts, [row["tokens_per_s_ratio"] for row in mine], "-o", label=label)[0]
    for key, style in (("on", "-o"), ("off", "--s")):
      side = f"{label}, hybrid {key}"
      values = [row[key]["tokens_per_s"] for row in mine]
      speed.plot(contexts, values, style, color=line.get_color(), label=side)
      recomputed.plot(contexts, [row[key]["recomputed_tokens"] for row in mine], style, color=line.get_color())
  ratio.axhline(1.0, color="gray", linewidth=0.8)
  recomputed.set_yscale("symlog", linthresh=1000)
  for ax, ylabel in (
      (ratio, "generated tokens/s, hybrid on / off"),
      (speed, "generated tokens / s"),
      (recomputed, "tokens computed again after preemptions"),
  ):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
  ratio.legend(fontsize=7)
  speed.legend(fontsize=6)
  fig.suptitle("hybrid_kv_cache on (solid) vs off (dashed), the same KV-cache bytes")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f"wrote {path}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The command line, with the defaults (or --quick's) filled in.

  Raises:
    SystemExit: a usage error (argparse's exit status 2).
  """
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", choices=tuple(MODELS), nargs="+", default=["gemma3"], help="models to run (gemma3)")
  parser.add_argument("--contexts", type=positive_int, nargs="+", default=None, help="request lengths (tokens)")
  parser.add_argument("--chunks", type=positive_int, nargs="+", default=None, help="max_num_batched_tokens values")
  parser.add_argument("--max-num-seqs", type=positive_int, nargs="+", default=None, help="max_num_seqs values")
  parser.add_argument(
      "--admission-reserve", choices=RESERVES, nargs="+", default=["none"], help="admission_reserve values (none)"
  )
  parser.add_argument("--prefix-caching", choices=("on", "off"), default="on", help="enable_prefix_caching (on)")
  parser.add_argument("--requests", type=positive_int, default=None, help=f"requests per run ({REQUESTS})")
  parser.add_argument("--new-tokens", type=positive_int, default=None, help="greedy tokens per request (256)")
  parser.add_argument("--cache-mib", type=positive_int, default=None, help="KV-cache MiB for every model")
  parser.add_argument("--plot", default="", help="write a PNG of the tok/s ratio, tok/s and recomputed tokens")
  add_output_flags(
      parser,
      f"context {QUICK['contexts']}, chunk {QUICK['chunks']}, seqs {QUICK['max_num_seqs']}, {QUICK['requests']}"
      f" requests, window {QUICK['window']}",
  )
  args = parser.parse_args(argv)
  args.window = QUICK["window"] if args.quick else None
  for key, default in (("contexts", CONTEXTS), ("chunks", CHUNKS), ("max_num_seqs", MAX_NUM_SEQS)):
    if getattr(args, key) is None:
      setattr(args, key, list(QUICK[key] if args.quick else default))
  if args.requests is None:
    args.requests = QUICK["requests"] if args.quick else REQUESTS
  if args.new_tokens is None:
    args.new_tokens = QUICK["new_tokens"] if args.quick else 256
  mib = dict(QUICK["mib"]) if args.quick else {name: model_mib for name, (_, model_mib) in MODELS.items()}
  args.cache_mib = {name: args.cache_mib or mib[name] for name in MODELS}
  if min(args.contexts) <= args.new_tokens:
    parser.error(f"--contexts must exceed --new-tokens ({args.new_tokens}); got {min(args.contexts)}")
  if min(args.chunks) < max(args.max_num_seqs):
    parser.error(
        f"every --chunks value must be >= every --max-num-seqs value (max_num_batched_tokens >= max_num_seqs);"
        f" got chunk {min(args.chunks)} and max_num_seqs {max(args.max_num_seqs)}"
    )
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  rows = [measure(cell, args) for cell in cells(args)]
  message = plot(rows, args.plot) if args.plot else ""
  settings = {
      k: getattr(args, k)
      for k in ("requests", "new_tokens", "cache_mib", "prefix_caching", "contexts", "chunks", "max_num_seqs", "quick")
  }
  header = (
      f"{args.requests} greedy requests of context - {args.new_tokens} prompt tokens + {args.new_tokens} generated,"
      f" block_size 16, prefix caching {args.prefix_caching}; on/off = hybrid_kv_cache true/false in the same bytes"
  )
  lines = [header, format_table(rows)] + ([message] if message else [])
  emit(args.json, {"settings": settings, "results": rows, "plot": message}, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
