"""Benchmark: automatic prefix caching on vs off for a shared-system-prompt workload on the hybrid families.

Every request is one long common system prompt plus a short request-specific suffix. The first request runs alone
(it computes the system prompt and, with `enable_prefix_caching=true`, leaves it cached), then the others run
together. The reference runner runs the workload with prefix caching off and on, for each hybrid family (Gated
DeltaNet or Mamba2 layers with full attention), after an untimed warm-up run of the same shapes with other tokens (so
compilation is not timed). Columns:
  prefill   prompt tokens the model computed (scheduled tokens minus the decode tokens fed back)
  hit_rate  prefix-cache hits / tokens looked up at admission
  steps     model steps of the timed run
  wall_s    wall time of the timed run; `speedup` = off / on of the same model
  same      whether the greedy tokens with prefix caching equal those without it

Timings are measurements only (CPU here); nothing is asserted.

Usage: python scripts/benchmark_prefix_caching.py [--system-tokens 384] [--requests 8] [--quick] [--json]
"""

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

import jax
import numpy as np

from support import kv_cache_checks
from support.benchmark_cli import add_output_flags, emit, positive_int
from maxtext.inference import LLM, SamplingParams

MODELS = ("qwen3-next-tiny", "qwen3.5-tiny", "granite4-tiny", "bamba-tiny")


def workload(seed: int, system_tokens: int, suffix_tokens: int, requests: int) -> list[list[int]]:
  """`requests` prompts: one seeded system prompt, then a different seeded suffix each."""
  rng = np.random.default_rng(seed)
  system = [int(t) for t in rng.integers(3, 512, system_tokens)]
  return [system + [int(t) for t in rng.integers(3, 512, suffix_tokens)] for _ in range(requests)]


def run(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
  """The first prompt alone, then the rest together; returns the tokens and the counters of this run."""
  engine = llm.engine
  before = dict(engine.stats.as_dict())
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  start = time.perf_counter()
  outs = llm.generate(list(prompts[:1]), params, use_tqdm=False) + llm.generate(list(prompts[1:]), params, use_tqdm=False)
  wall = time.perf_counter() - start
  after = engine.stats.as_dict()
  delta = {k: after[k] - before[k] for k in ("steps", "scheduled_tokens", "generated_tokens", "prefix_cache_hits")}
  queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
  decode_fed = delta["generated_tokens"] - len(prompts)  # every output but the last of each request is fed back
  stats = {
      "prompt_tokens": sum(len(p) for p in prompts),
      "prefill_tokens": delta["scheduled_tokens"] - decode_fed,
      "hit_rate": delta["prefix_cache_hits"] / queries if queries else 0.0,
      "steps": delta["steps"],
      "wall_s": wall,
  }
  return [list(o.outputs[0].token_ids) for o in outs], stats


def measure(model: str, apc: bool, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, Any]]:
  """One engine: an untimed warm-up run, then the timed run."""
  llm = LLM(
      model_name=model,
      enable_prefix_caching=apc,
      block_size=args.block_size,
      mamba_block_size=args.mamba_block_size,
      num_kv_blocks=args.num_kv_blocks,
      max_num_seqs=args.requests,
      max_num_batched_tokens=args.max_num_batched_tokens,
      max_target_length=args.system_tokens + args.suffix_tokens + args.max_tokens + 1,
  )
  shape = (args.system_tokens, args.suffix_tokens, args.requests)
  run(llm, workload(1, *shape), args.max_tokens)
  tokens, stats = run(llm, workload(2, *shape), args.max_tokens)
  assert kv_cache_checks.all_free(llm.engine.manager), "blocks or state blocks leaked"
  return tokens, {"model": model, "prefix_caching": apc, **stats}


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of the rows (pairs off / on per model)."""
  header = (
      f"{'model':<16} {'apc':<4} {'prompt':>6} {'prefill':>7} {'hit_rate':>8} {'steps':>5} {'wall_s':>7} "
      f"{'speedup':>7} {'same':>5}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    speedup = f"{row['speedup']:.2f}" if "speedup" in row else ""
    same = str(row["same_tokens"]) if "same_tokens" in row else ""
    lines.append(
        f"{row['model']:<16} {'on' if row['prefix_caching'] else 'off':<4} {row['prompt_tokens']:>6} "
        f"{row['prefill_tokens']:>7} {row['hit_rate']:>8.3f} {row['steps']:>5} {row['wall_s']:>7.2f} {speedup:>7} "
        f"{same:>5}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="hybrid families to run")
  parser.add_argument("--system-tokens", type=positive_int, default=None, help="shared system prompt (384)")
  parser.add_argument("--suffix-tokens", type=positive_int, default=None, help="tokens per request after it (16)")
  parser.add_argument("--requests", type=positive_int, default=None, help="requests sharing the prompt (8)")
  parser.add_argument("--max-tokens", type=positive_int, default=None, help="tokens generated per request (8)")
  parser.add_argument("--block-size", type=positive_int, default=16, help="attention block size")
  parser.add_argument("--mamba-block-size", type=int, default=0, help="tokens per state block (0 = block size)")
  parser.add_argument("--num-kv-blocks", type=positive_int, default=512, help="blocks per KV-cache group")
  parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="token budget per step")
  add_output_flags(parser, "a 32-token system prompt, 3 requests, 2 new tokens")
  args = parser.parse_args(argv)
  args.system_tokens = args.system_tokens or (32 if args.quick else 384)
  args.suffix_tokens = args.suffix_tokens or (4 if args.quick else 16)
  args.requests = args.requests or (3 if args.quick else 8)
  args.max_tokens = args.max_tokens or (2 if args.quick else 8)
  if args.mamba_block_size < 0 or args.mamba_block_size % args.block_size:
    parser.error(f"--mamba-block-size must be 0 or a multiple of --block-size, got {args.mamba_block_size}")
  rows = []
  for model in args.models:
    off_tokens, off = measure(model, False, args)
    on_tokens, on = measure(model, True, args)
    on["speedup"] = off["wall_s"] / on["wall_s"]
    on["same_tokens"] = on_tokens == off_tokens
    rows += [off, on]
  settings = {
      k: getattr(args, k)
      for k in ("system_tokens", "suffix_tokens", "requests", "max_tokens", "block_size", "mamba_block_size")
  }
  settings["max_num_batched_tokens"] = args.max_num_batched_tokens
  settings["backend"] = jax.default_backend()
  header = (
      f"{args.requests} requests sharing a {args.system_tokens}-token system prompt (+{args.suffix_tokens} tokens"
      f" each, {args.max_tokens} new), first alone then the rest; block_size {args.block_size}, mamba_block_size"
      f" {args.mamba_block_size or args.block_size}, backend {jax.default_backend()}"
  )
  emit(args.json, {"settings": settings, "results": rows}, [header, format_table(rows)])
  return 0


if __name__ == "__main__":
  sys.exit(main())
