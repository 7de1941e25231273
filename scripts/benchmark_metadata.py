"""Benchmark: one AttentionMetadata per KV-cache group (what the engine passes) vs one per layer.

A 24-layer Gemma3-like model (5 sliding layers, window 128, per full-attention layer; test-size widths) runs one
decode step of `--requests` requests through the adapter, jitted with the caches donated, as the engine does.
The step's metadata is passed two ways:
  grouped    a `GroupedAttentionMetadata`: one `AttentionMetadata` per group, shared by the group's layers
  per_layer  a plain `{layer_name: AttentionMetadata}` dict with a separate copy of the arrays for every layer
For each it reports the metadata's pytree leaves, the jaxpr equations (all, and those spent on values derived
from the metadata alone: every input is metadata, a metadata-derived value or a constant), the compiled HLO
instruction count, the compile time (lower + compile) and the mean / min step time.

Timings are measurements only (CPU here); nothing is asserted.

Usage: python scripts/benchmark_metadata.py [--layers 24] [--requests 4] [--repeats 20] [--quick] [--json]
"""

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

import jax
import jax.extend as jex
import jax.numpy as jnp
from flax import nnx

from support import hlo
from support.benchmark_cli import add_output_flags, emit, positive_int
from maxtext.checkpoint import load_run_config
from maxtext.inference import SamplingParams
from maxtext.inference.batch import build_batch
from maxtext.inference.engine import LLMEngine
from maxtext.inference.engine_programs import make_attention_metadata, metadata_positions
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata

MODES = ("grouped", "per_layer")
CONST, META, OTHER = 0, 1, 2  # ordered: a result takes the largest kind of its inputs


def _kind(var: Any, kinds: dict[Any, int]) -> int:
  if isinstance(var, jex.core.Literal):
    return CONST
  return kinds.get(var, OTHER)


def _sub_jaxprs(eqn: Any) -> list[Any]:
  subs = []
  for value in eqn.params.values():
    for sub in value if isinstance(value, tuple) else (value,):
      if isinstance(sub, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
        subs.append(sub)
  return subs


def count_metadata_equations(jaxpr: Any, input_kinds: Sequence[int], const_kind: int = CONST) -> tuple[int, list]:
  """Counts the equations whose result depends on metadata inputs and constants only.

  Nested jit / call bodies are followed with their inputs' kinds; any other nested jaxpr (scan, while, cond)
  counts as a whole when its operands are metadata-derived.

  Args:
    jaxpr: a ClosedJaxpr or Jaxpr.
    input_kinds: per invar, `META` (metadata), `CONST` or `OTHER`.
    const_kind: the kind of the jaxpr's constvars.

  Returns:
    (equation count, the kind of every outvar).
  """
  if isinstance(jaxpr, jex.core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  kinds = dict(zip(jaxpr.invars, input_kinds))
  kinds.update({v: const_kind for v in jaxpr.constvars})
  count = 0
  for eqn in jaxpr.eqns:
    in_kinds = [_kind(v, kinds) for v in eqn.invars]
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call") and inner is not None:
      sub_count, out_kinds = count_metadata_equations(inner, in_kinds)
      count += sub_count
    else:
      kind = max(in_kinds, default=CONST)
      out_kinds = [kind] * len(eqn.outvars)
      if kind == META:
        count += 1 + sum(hlo.count_jaxpr_equations(sub) for sub in _sub_jaxprs(eqn))
    kinds.update(zip(eqn.outvars, out_kinds))
  return count, [_kind(v, kinds) for v in jaxpr.outvars]


def per_layer_metadata(grouped: AttentionMetadata | GroupedAttentionMetadata, num_layers: int) -> dict[str, Any]:
  """`{layer.i: AttentionMetadata}` with fresh copies of the arrays of each layer's group metadata."""
  out = {}
  for i in range(num_layers):
    name = f"layer.{i}"
    md = grouped if isinstance(grouped, AttentionMetadata) else grouped[name]
    arrays = [f.name for f in dataclasses.fields(md) if f.name != "padded_num_reqs" and getattr(md, f.name) is not None]
    out[name] = dataclasses.replace(md, **{k: jnp.array(getattr(md, k)) for k in arrays})
  return out


def decode_step_inputs(num_layers: int, num_requests: int, quick: bool) -> tuple[LLMEngine, Any, Any]:
  """An engine of the benchmark model whose requests have prefilled, and the next (decode) step's batch."""
  cfg = load_run_config(
      model_name="gemma3-tiny",
      base_num_decoder_layers=num_layers,
      inhomogeneous_layer_cycle_interval=6,
      sliding_window_size=16 if quick else 128,
      block_size=16,
      num_kv_blocks=64,
      max_num_seqs=max(8, num_requests),
      compilation_cache_dir="",  # compile times are measured: no program comes from an earlier run's folder
  )
  engine = LLMEngine(cfg)
  for i in range(num_requests):
    engine.add_request([3 + (7 * i + j) % 500 for j in range(24)], SamplingParams(temperature=0.0, max_tokens=8))
  engine.step()  # prefill every request; the next schedule is one decode token each
  out = engine.scheduler.schedule()
  return engine, build_batch(cfg, out, engine.manager), out


def measure(engine: LLMEngine, batch: Any, mode: str, repeats: int) -> dict[str, Any]:
  """Program size, compile time and step time of one metadata form."""
  grouped = make_attention_metadata(batch)
  metadata = grouped if mode == "grouped" else per_layer_metadata(grouped, engine.model.num_layers)
  positions = metadata_positions(grouped)
  graphdef, state = nnx.split(engine.model)

  def step(state, kv_caches, input_ids, attention_metadata, input_positions, layer_map):
    model = nnx.merge(graphdef, state)
    kv_caches, hidden, _, _ = model(
        kv_caches, input_ids, attention_metadata, None, input_positions, layer_map, None, None, True, True
    )
    return kv_caches, hidden

  kv_caches = engine.kv_caches
  input_ids = jnp.asarray(batch.input_ids)
  args = (state, kv_caches, input_ids, metadata, positions)
  closed = jax.make_jaxpr(step, static_argnums=5)(*args, engine.layer_map)
  input_kinds = []
  for index, arg in enumerate(args):
    input_kinds += [META if index >= 3 else OTHER] * len(jax.tree_util.tree_leaves(arg))
  metadata_eqns, _ = count_metadata_equations(closed, input_kinds)
  jax.clear_caches()  # both forms must compile from scratch
  start = time.perf_counter()
  compiled = jax.jit(step, static_argnums=5, donate_argnums=1).lower(*args, engine.layer_map).compile()
  compile_s = time.perf_counter() - start
  kv_caches, _ = jax.block_until_ready(compiled(state, kv_caches, input_ids, metadata, positions))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    kv_caches, _ = jax.block_until_ready(compiled(state, kv_caches, input_ids, metadata, positions))
    times.append(time.perf_counter() - start)
  engine.kv_caches = kv_caches  # the donated originals are gone
  return {
      "mode": mode,
      "metadata_leaves": len(jax.tree_util.tree_leaves(metadata)),
      "jaxpr_eqns": hlo.count_jaxpr_equations(closed),
      "metadata_eqns": metadata_eqns,
      "hlo_instructions": hlo.count_hlo_instructions(compiled.as_text()),
      "compile_s": compile_s,
      "step_ms_mean": 1e3 * statistics.fmean(times),
      "step_ms_min": 1e3 * min(times),
  }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` results."""
  header = (
      f"{'mode':<10} {'md_leaves':>9} {'jaxpr_eqns':>10} {'md_eqns':>7} {'hlo_instr':>9} {'compile_s':>9} "
      f"{'step_ms':>8} {'min_ms':>7}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    lines.append(
        f"{row['mode']:<10} {row['metadata_leaves']:>9} {row['jaxpr_eqns']:>10} {row['metadata_eqns']:>7} "
        f"{row['hlo_instructions']:>9} {row['compile_s']:>9.3f} {row['step_ms_mean']:>8.3f} {row['step_ms_min']:>7.3f}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=positive_int, default=None, help="decoder layers (24; a multiple of 6)")
  parser.add_argument("--requests", type=positive_int, default=4, help="requests in the decode step")
  parser.add_argument("--repeats", type=positive_int, default=None, help="timed steps per form (20)")
  add_output_flags(parser, "12 layers, window 16, 2 timed steps")
  args = parser.parse_args(argv)
  layers = args.layers or (12 if args.quick else 24)
  repeats = args.repeats or (2 if args.quick else 20)
  if layers % 6:
    parser.error(f"--layers must be a multiple of 6 (5 sliding : 1 full), got {layers}")
  engine, batch, _ = decode_step_inputs(layers, args.requests, args.quick)
  rows = [measure(engine, batch, mode, repeats) for mode in MODES]
  settings = {"layers": layers, "requests": args.requests, "repeats": repeats, "backend": jax.default_backend()}
  header = (
      f"{layers} layers (5 sliding : 1 full), one decode step of {args.requests} requests, {repeats} timed steps, "
      f"caches donated, backend {jax.default_backend()}"
  )
  emit(args.json, {"settings": settings, "results": rows}, [header, format_table(rows)])
  return 0


if __name__ == "__main__":
  sys.exit(main())
