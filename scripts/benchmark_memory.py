"""Benchmark: KV-cache bytes per request, and what a fixed cache budget holds, with hybrid_kv_cache on and off.

Five hybrid configs (test-size widths; the cache arithmetic depends only on layer kinds, KV heads, head_dim, block
size and window):
  gemma3      12 layers, 5 sliding (window 128) : 1 full attention, block 16 (6 groups of 2 layers, 2 arrays)
  qwen3_next  8 layers, 3 Gated DeltaNet : 1 full attention, block 16 (no sliding layers)
  gpt_oss     4 layers, 1 sliding (window 128, gpt-oss's) : 1 full attention, block 16, head_dim 64
  granite_hybrid, bamba  4 layers, 3 Mamba2 : 1 full attention, block 16 (no sliding layers)
For every context length it grows one request to that length through the KV-cache manager (chunked prefill of
`--chunk` tokens, then one decode token, so sliding groups have freed what no query can reach) and counts the bytes
it holds: the block ids it holds over every group x the bytes of one block id over every attention array (an id
names that block in every array, so it is spent in all of them), plus its recurrent state slot. It reports that
with `hybrid_kv_cache=true` and `false`, their ratio, and the theoretical ratio
  (attention layers x C) / (full layers x C + sliding layers x min(C, W))    (recurrent bytes added to both sides).
The budget is the bytes of `--budget-blocks` blocks per layer with `hybrid_kv_cache=false`; both modes get those
bytes (`kv_cache_memory_bytes`), each as many blocks as its layout holds. It then admits requests of that length
until the allocator refuses one (max concurrent requests, as allocated), next to budget bytes / bytes per request.
For contexts up to `--throughput-max-context` it also runs the engine: `min(max concurrent, --max-seqs)` requests
of that length generating `--new-tokens` tokens each, reporting generated tokens/s of the call (prefill included,
after a warm-up call of the same shapes).

Timings are measurements only; nothing is asserted.

Usage: python scripts/benchmark_memory.py [--contexts 256 512 ... 8192] [--budget-blocks 2048] [--chunk 256]
                                          [--throughput-max-context 1024] [--max-seqs 8] [--new-tokens 8]
                                          [--plot PATH.png] [--quick] [--json]
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
from maxtext.inference import LLM, SamplingParams
from maxtext.inference.engine_build import make_kv_cache_manager
from maxtext.inference.kv_cache_capacity import cache_bytes
from maxtext.inference.kv_cache_manager import ATTENTION, KVCacheManager
from maxtext.kv_cache import kv_cache_spec

CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
# name -> config overrides (model_name first)
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "model_name": "gemma3-tiny",
        "base_num_decoder_layers": 12,
        "inhomogeneous_layer_cycle_interval": 6,
        "sliding_window_size": 128,
    },
    "qwen3_next": {"model_name": "qwen3-next-tiny"},
    "gpt_oss": {"model_name": "gpt-oss-tiny", "sliding_window_size": 128},
    "granite_hybrid": {"model_name": "granite4-tiny"},
    "bamba": {"model_name": "bamba-tiny"},
}
QUICK_CONTEXTS = (64, 256)
QUICK_WINDOW = 32


def config_overrides(
    name: str, *, hybrid: bool, context: int, budget_bytes: int, max_seqs: int, chunk: int, quick: bool
) -> dict[str, Any]:
  """The config keys of one case (for `load_run_config` and `LLM`); `budget_bytes` 0 sizes nothing."""
  overrides = dict(CONFIGS[name])
  if quick and "sliding_window_size" in overrides:
    overrides["sliding_window_size"] = QUICK_WINDOW
  return dict(
      overrides,
      hybrid_kv_cache=hybrid,
      block_size=16,
      kv_cache_memory_bytes=budget_bytes,
      max_target_length=context + 64,
      max_num_seqs=max_seqs,
      max_num_batched_tokens=chunk,
  )


def grow_request(manager: KVCacheManager, request_id: str, context: int, chunk: int) -> bool:
  """Allocates a request's blocks as the scheduler would: prefill `context - 1` tokens in chunks, one decode token.

  Returns:
    False when the allocator refuses a step (the request keeps what it got).
  """
  computed = 0
  while computed < context - 1:
    step = min(chunk, context - 1 - computed)
    if not manager.allocate_slots(request_id, computed, step):
      return False
    computed += step
  return manager.allocate_slots(request_id, computed, 1)


def request_bytes(manager: KVCacheManager, request_id: str) -> int:
  """Cache bytes a request holds: its block ids over every attention group times the bytes of an id over every
  attention array, plus its recurrent state."""
  recurrent = sum(e.nbytes // manager.num_state_slots for e in manager.describe_slots() if e.kind != ATTENTION)
  ids = sum(1 for gid in manager.attention_group_ids for block in manager.block_table(request_id, gid) if block != 0)
  return ids * manager.block_bytes + recurrent


def theoretical_ratio(manager: KVCacheManager, context: int) -> float:
  """Bytes per request keeping every block / keeping only the window, from the layer kinds and page sizes."""
  keep_all, windowed = 0.0, 0.0
  recurrent = sum(e.nbytes / manager.num_state_slots for e in manager.describe_slots() if e.kind != ATTENTION)
  for spec in kv_cache_spec.get_kv_cache_specs(manager.cfg).values():
    if spec.cache_kind != ATTENTION:
      continue
    per_token = spec.page_size_bytes() / spec.block_size
    window = spec.sliding_window
    keep_all += per_token * context
    windowed += per_token * (min(context, window) if window else context)
  return (keep_all + recurrent) / (windowed + recurrent)


def max_concurrent(manager: KVCacheManager, context: int, chunk: int) -> int:
  """Requests of `context` tokens the allocator admits before it refuses one."""
  count = 0
  while grow_request(manager, f"r{count}", context, chunk):
    count += 1
  return count


def decode_throughput(overrides: dict[str, Any], context: int, num_requests: int, new_tokens: int) -> dict[str, Any]:
  """Engine tokens/s of `num_requests` requests of `context` tokens (prefill included), in a second call."""
  llm = LLM(**overrides)
  prompt_len = context - new_tokens
  prompts = [[3 + (i * 7 + j) % 500 for j in range(prompt_len)] for i in range(num_requests)]
  params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
  llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles every step shape of the call
  stats = llm.engine.stats
  before = (stats.generated_tokens, stats.step_traces)
  start = time.perf_counter()
  llm.generate(prompts, params, use_tqdm=False)
  elapsed = time.perf_counter() - start
  return {
      "requests": num_requests,
      "tokens_per_s": (stats.generated_tokens - before[0]) / elapsed,
      "recompilations": stats.step_traces - before[1],
  }


def measure(name: str, context: int, args: argparse.Namespace) -> dict[str, Any]:
  """Bytes per request, ratios, capacity and (for short contexts) throughput of one (config, context) case."""
  row: dict[str, Any] = {"config": name, "context": context}
  common = {"context": context, "max_seqs": args.max_seqs, "chunk": args.chunk, "quick": args.quick}
  flat = load_run_config(
      **config_overrides(name, hybrid=False, budget_bytes=0, **common), num_kv_blocks=args.budget_blocks
  )
  budget = cache_bytes(make_kv_cache_manager(flat))
  for hybrid in (True, False):
    key = "hybrid" if hybrid else "flat"
    overrides = config_overrides(name, hybrid=hybrid, budget_bytes=budget, **common)
    cfg = load_run_config(**overrides)
    manager = make_kv_cache_manager(cfg)
    if not grow_request(manager, "probe", context, args.chunk):
      raise SystemExit(f"benchmark_memory: one {context}-token request does not fit {budget} bytes")
    per_request = request_bytes(manager, "probe")
    manager.free("probe")
    row[f"{key}_bytes_per_request"] = per_request
    row[f"{key}_max_concurrent"] = max_concurrent(make_kv_cache_manager(cfg), context, args.chunk)
    row[f"{key}_pooled_capacity"] = budget // per_request
    if hybrid:
      row["theoretical_ratio"] = theoretical_ratio(manager, context)
      row["budget_bytes"] = budget
    if context <= args.throughput_max_context:
      num_requests = min(row[f"{key}_max_concurrent"], args.max_seqs)
      row[f"{key}_decode"] = decode_throughput(overrides, context, num_requests, args.new_tokens)
  row["measured_ratio"] = row["flat_bytes_per_request"] / row["hybrid_bytes_per_request"]
  return row


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` results."""
  header = (
      f"{'config':<11} {'context':>7} {'hybrid_B/req':>12} {'flat_B/req':>11} {'ratio':>6} {'theory':>6} "
      f"{'max_req h/f':>11} {'pooled h/f':>11} {'decode tok/s h/f':>17}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    decode = "-"
    if "hybrid_decode" in row:
      decode = f"{row['hybrid_decode']['tokens_per_s']:.1f}/{row['flat_decode']['tokens_per_s']:.1f}"
    lines.append(
        f"{row['config']:<11} {row['context']:>7} {row['hybrid_bytes_per_request']:>12} "
        f"{row['flat_bytes_per_request']:>11} {row['measured_ratio']:>6.2f} {row['theoretical_ratio']:>6.2f} "
        f"{row['hybrid_max_concurrent']:>5}/{row['flat_max_concurrent']:<5} "
        f"{row['hybrid_pooled_capacity']:>5}/{row['flat_pooled_capacity']:<5} {decode:>17}"
    )
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> str:
  """Writes bytes per request against context (log-log), per config and mode; returns a message."""
  plt, skipped = pyplot(path)
  if plt is None:
    return skipped
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in dict.fromkeys(row["config"] for row in rows):
    mine = [row for row in rows if row["config"] == name]
    contexts = [row["context"] for row in mine]
    for key, style in (("hybrid", "-o"), ("flat", "--s")):
      ax.plot(contexts, [row[f"{key}_bytes_per_request"] / 2**20 for row in mine], style, label=f"{name} {key}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("KV-cache MiB per request")
  ax.set_title("hybrid_kv_cache=true (hybrid) vs false (flat)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return f"wrote {path}"


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", choices=tuple(CONFIGS), nargs="+", default=list(CONFIGS), help="configs to run")
  parser.add_argument("--contexts", type=positive_int, nargs="+", default=None, help="request lengths (tokens)")
  parser.add_argument(
      "--budget-blocks", type=positive_int, default=None, help="cache bytes of this many blocks per layer (2048)"
  )
  parser.add_argument("--chunk", type=positive_int, default=256, help="prefill chunk (max_num_batched_tokens)")
  parser.add_argument("--throughput-max-context", type=int, default=None, help="longest context run (1024)")
  parser.add_argument("--max-seqs", type=positive_int, default=8, help="most requests decoded together")
  parser.add_argument("--new-tokens", type=positive_int, default=8, help="tokens decoded per request")
  parser.add_argument("--plot", default="", help="write a PNG of bytes per request vs context (needs matplotlib)")
  add_output_flags(parser, f"contexts {QUICK_CONTEXTS}, window {QUICK_WINDOW}")
  args = parser.parse_args(argv)
  if args.contexts is None:
    args.contexts = list(QUICK_CONTEXTS if args.quick else CONTEXTS)
  if args.budget_blocks is None:
    args.budget_blocks = 64 if args.quick else 2048
  if args.throughput_max_context is None:
    args.throughput_max_context = 64 if args.quick else 1024
  if args.quick:
    args.max_seqs, args.new_tokens = min(args.max_seqs, 2), min(args.new_tokens, 2)
  if min(args.contexts) <= args.new_tokens:
    parser.error(f"--contexts must exceed --new-tokens ({args.new_tokens}); got {min(args.contexts)}")

  rows = [measure(name, context, args) for name in args.configs for context in args.contexts]
  message = plot(rows, args.plot) if args.plot else ""
  settings = {k: getattr(args, k) for k in ("budget_blocks", "chunk", "max_seqs", "new_tokens", "quick")}
  header = (
      f"block_size 16, budget: the bytes of {args.budget_blocks} blocks per layer, prefill chunk {args.chunk}; "
      "h/f = hybrid_kv_cache true/false"
  )
  lines = [header, format_table(rows)] + ([message] if message else [])
  emit(args.json, {"settings": settings, "results": rows, "plot": message}, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
