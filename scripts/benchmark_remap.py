"""Benchmark: what honoring the runner's KV-cache map costs in a jitted gather -> update -> scatter step.

For each layer count and physical layout it measures the jaxpr equation count, the compiled HLO instruction
count, the compile time (lower + compile) and the mean step time with the caches donated. Layers follow the
Qwen3.5 pattern (three Gated DeltaNet layers, then one full-attention layer). Layouts:
  direct    slot i is layer i and the step indexes kv_caches[i] itself (no remap at all: the baseline)
  identity  slot i is layer i, through resolve / gather / scatter
  hybrid    recurrent states first, then attention caches, as tpu-inference allocates them
  shuffled  a seeded random permutation of the slots

Timings are measurements only (CPU, 2 cores here); nothing is asserted.

Usage: python scripts/benchmark_remap.py [--layers 8 48] [--layouts direct identity hybrid shuffled]
                                         [--repeats 20] [--seed 0] [--quick] [--json]
"""

import argparse
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

import jax
import jax.numpy as jnp

from support import hlo
from support.benchmark_cli import add_output_flags, emit, positive_int
from maxtext.kv_cache import hybrid_cache_utils as hcu

LAYOUTS = ("direct", "identity", "hybrid", "shuffled")
FULL_ATTENTION_INTERVAL = 4  # layer i is full attention iff (i + 1) % 4 == 0, else a GDN layer
# Small runner-shaped caches (docs/runner-contract.md): GDN conv [M, K-1, C] bf16 and ssm [M, nv, dk, dv] fp32;
# attention [N, bs, 2Hkv/pk, pk, D] bf16.
CONV_SHAPE, SSM_SHAPE = (8, 3, 64), (8, 4, 16, 16)
ATTENTION_SHAPE = (32, 16, 2, 2, 128)


def is_recurrent(layer: int) -> bool:
  """True for the Gated DeltaNet (recurrent-state) layers of the Qwen3.5 pattern."""
  return (layer + 1) % FULL_ATTENTION_INTERVAL != 0


def layout_slots(layout: str, num_layers: int, seed: int) -> tuple[int, ...]:
  """Slot of every layer under `layout`."""
  if layout in ("direct", "identity"):
    return tuple(range(num_layers))
  if layout == "hybrid":
    order = sorted(range(num_layers), key=lambda layer: not is_recurrent(layer))  # stable: layer order per kind
  else:
    order = list(range(num_layers))
    random.Random(seed).shuffle(order)
  slot_of = {layer: slot for slot, layer in enumerate(order)}
  return tuple(slot_of[layer] for layer in range(num_layers))


def allocate_kv_caches(slots: tuple[int, ...]) -> list[Any]:
  """Zero-filled caches in physical order: a (conv, ssm) tuple per recurrent slot, an array per attention slot."""
  caches: list[Any] = [None] * len(slots)
  for layer, slot in enumerate(slots):
    if is_recurrent(layer):
      caches[slot] = (jnp.zeros(CONV_SHAPE, jnp.bfloat16), jnp.zeros(SSM_SHAPE, jnp.float32))
    else:
      caches[slot] = jnp.zeros(ATTENTION_SHAPE, jnp.bfloat16)
  return caches


def _update_layer(layer: int, cache: Any, value: jax.Array) -> Any:
  """Stands in for a layer's cache write: one GDN state slot, or one attention block row."""
  if isinstance(cache, tuple):
    conv, ssm = cache
    return (conv.at[1].set((value + layer).astype(conv.dtype)), ssm.at[1].add(value + layer))
  return cache.at[2, 0].set((value + layer).astype(cache.dtype))


def remap_step(kv_caches: list[Any], layer_name_to_kvcache_index: tuple[tuple[str, int], ...], value: jax.Array):
  """Resolve the static map, gather in layer order, update every layer, scatter back to the physical order."""
  num_layers = len(layer_name_to_kvcache_index)
  layer_indices = hcu.resolve_layer_kv_cache_indices(layer_name_to_kvcache_index, num_layers, len(kv_caches))
  layer_caches = hcu.gather_layer_kv_caches(kv_caches, layer_indices)
  updated = [_update_layer(layer, cache, value) for layer, cache in enumerate(layer_caches)]
  return hcu.scatter_layer_kv_caches(kv_caches, updated, layer_indices)


def direct_step(kv_caches: list[Any], layer_name_to_kvcache_index: tuple[tuple[str, int], ...], value: jax.Array):
  """The baseline: ignores the map and indexes kv_caches[i] (correct only for the layer-order layout)."""
  del layer_name_to_kvcache_index
  return [_update_layer(layer, cache, value) for layer, cache in enumerate(kv_caches)]


def measure(num_layers: int, layout: str, repeats: int, seed: int) -> dict[str, Any]:
  """Program size, compile time and step time of one (layer count, layout) case."""
  slots = layout_slots(layout, num_layers, seed)
  pairs = tuple((hcu.layer_name(layer), slot) for layer, slot in enumerate(slots))
  step = direct_step if layout == "direct" else remap_step
  kv_caches = allocate_kv_caches(slots)
  value = jnp.float32(1.0)

  eqns = hlo.count_jaxpr_equations(jax.make_jaxpr(step, static_argnums=1)(kv_caches, pairs, value))
  jax.clear_caches()  # a case whose program equals an earlier one's (e.g. hybrid == identity) must still compile
  start = time.perf_counter()
  compiled = jax.jit(step, static_argnums=1, donate_argnums=0).lower(kv_caches, pairs, value).compile()
  compile_s = time.perf_counter() - start

  kv_caches = jax.block_until_ready(compiled(kv_caches, value))  # warm-up
  step_times = []
  for _ in range(repeats):
    start = time.perf_counter()
    kv_caches = jax.block_until_ready(compiled(kv_caches, value))
    step_times.append(time.perf_counter() - start)
  return {
      "layers": num_layers,
      "layout": layout,
      "jaxpr_eqns": eqns,
      "hlo_instructions": hlo.count_hlo_instructions(compiled.as_text()),
      "compile_s": compile_s,
      "step_ms_mean": 1e3 * statistics.fmean(step_times),
      "step_ms_min": 1e3 * min(step_times),
  }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` results."""
  header = (
      f"{'layers':>6}  {'layout':<9} {'jaxpr_eqns':>10} {'hlo_instr':>9} {'compile_s':>9} {'step_ms':>8} {'min_ms':>7}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    lines.append(
        f"{row['layers']:>6}  {row['layout']:<9} {row['jaxpr_eqns']:>10} {row['hlo_instructions']:>9} "
        f"{row['compile_s']:>9.3f} {row['step_ms_mean']:>8.3f} {row['step_ms_min']:>7.3f}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=positive_int, nargs="+", default=None, help="decoder layer counts (8 48)")
  parser.add_argument("--layouts", choices=LAYOUTS, nargs="+", default=list(LAYOUTS), help="physical layouts")
  parser.add_argument("--repeats", type=positive_int, default=None, help="timed steps per case after a warm-up (20)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled layout")
  add_output_flags(parser, "8 layers, 2 timed steps (a smoke run)")
  args = parser.parse_args(argv)
  args.layers = args.layers or ([8] if args.quick else [8, 48])
  args.repeats = args.repeats or (2 if args.quick else 20)

  rows = [measure(n, layout, args.repeats, args.seed) for n in args.layers for layout in args.layouts]
  header = f"backend: {jax.default_backend()}, {args.repeats} timed steps per case, caches donated"
  emit(
      args.json,
      {"backend": jax.default_backend(), "repeats": args.repeats, "results": rows},
      [header, format_table(rows)],
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
