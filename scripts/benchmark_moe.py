"""Benchmark: routed experts as the tiled loop (XLA) vs the CPU kernel's rows (`experts_cpu_rows`), side by side.

A chain of `--layers` MoE layers (`x = x + moe(rms_norm(x))`; a softmax top-k router of its own per layer, so
routing depends on the data as in a model) of Qwen3-Next's decode-benchmark size (16 experts of 512 x 256, top-2,
fp32) runs jitted at each token count, in two forms:
  tiled     `kernels.moe.experts_tiled`: the rows sorted by expert, a loop over one-expert tiles (XLA copies each
            tile's expert matrices out of the stacked weights before its products)
  cpu_rows  `kernels.cpu.cpu_moe.experts_cpu_rows`: every row times its expert's matrices where they lie, through the
            small-batch CPU kernel's `expert_matmul` (x86-64 with AVX2 and FMA only; skipped elsewhere)
For each it reports the compile time (lower + compile), the best and median time of a call (the forms alternate,
call by call, so drift on a shared machine hits both alike), the ratio to tiled, and the largest difference from
tiled's output relative to its largest magnitude.

Timings are measurements only; on a shared machine compare ratios from one run.

Usage: python scripts/benchmark_moe.py [--tokens 1 8 64 128 256 512] [--layers 8] [--repeats 10] [--quick] [--json]
"""

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

import jax
import jax.numpy as jnp
import numpy as np

from support.benchmark_cli import add_output_flags, emit, positive_int
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.cpu_moe import experts_cpu_rows
from maxtext.kernels.moe import experts_tiled
from maxtext.layers.moe import route

FORMS: dict[str, Callable[..., jax.Array]] = {"tiled": experts_tiled, "cpu_rows": experts_cpu_rows}


def make_layers(num_layers: int, experts: int, dim: int, mlp: int, seed: int = 0) -> list[dict[str, jax.Array]]:
  """Seeded random weights of each layer: router `[D, E]`, gate / up `[E, D, F]`, down `[E, F, D]`."""
  rng = np.random.default_rng(seed)
  scale = 1.0 / np.sqrt(dim)
  layers = []
  for _ in range(num_layers):
    layer = {
        "router": rng.normal(size=(dim, experts)) * scale,
        "gate": rng.normal(size=(experts, dim, mlp)) * scale,
        "up": rng.normal(size=(experts, dim, mlp)) * scale,
        "down": rng.normal(size=(experts, mlp, dim)) / np.sqrt(mlp),
    }
    layers.append({name: jnp.asarray(value, jnp.float32) for name, value in layer.items()})
  return layers


def chain(form: Callable[..., jax.Array], top_k: int, layers: Sequence[dict[str, jax.Array]], x: jax.Array):
  """`x + moe(rms_norm(x))` through every layer, the experts computed by `form`."""
  for layer in layers:
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    weights, indices = route(h @ layer["router"], top_k=top_k, normalize=True)
    x = x + form(
        h, weights, indices, layer["gate"], layer["up"], layer["down"], activation=jax.nn.silu, dtype=jnp.float32
    )
  return x


def measure(tokens: int, forms: Sequence[str], layers: list, top_k: int, repeats: int) -> list[dict[str, Any]]:
  """Compiles and times every form at one token count; returns one row per form."""
  dim = layers[0]["router"].shape[0]
  x = jnp.asarray(np.random.default_rng(tokens).normal(size=(tokens, dim)), jnp.float32)
  compiled, compile_s, outputs = {}, {}, {}
  for form in forms:
    start = time.perf_counter()
    compiled[form] = jax.jit(lambda layers, x, fn=FORMS[form]: chain(fn, top_k, layers, x)).lower(layers, x).compile()
    compile_s[form] = time.perf_counter() - start
    outputs[form] = np.asarray(compiled[form](layers, x))  # also the warm-up call
  times: dict[str, list[float]] = {form: [] for form in forms}
  for _ in range(repeats):
    for form in forms:
      start = time.perf_counter()
      jax.block_until_ready(compiled[form](layers, x))
      times[form].append(time.perf_counter() - start)
  reference = outputs[forms[0]]
  scale = max(float(np.max(np.abs(reference))), 1e-30)
  return [
      {
          "tokens": tokens,
          "form": form,
          "compile_s": compile_s[form],
          "best_ms": 1e3 * min(times[form]),
          "median_ms": 1e3 * statistics.median(times[form]),
          "vs_tiled": min(times[form]) / min(times[forms[0]]),
          "max_rel_diff": float(np.max(np.abs(outputs[form] - reference))) / scale,
      }
      for form in forms
  ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `measure` rows."""
  header = f"{'tokens':>6} {'form':<9} {'compile_s':>9} {'best_ms':>9} {'median_ms':>9} {'vs_tiled':>8} {'rel_diff':>9}"
  lines = [header, "-" * len(header)]
  for row in rows:
    lines.append(
        f"{row['tokens']:>6} {row['form']:<9} {row['compile_s']:>9.2f} {row['best_ms']:>9.3f} "
        f"{row['median_ms']:>9.3f} {row['vs_tiled']:>8.2f} {row['max_rel_diff']:>9.1e}"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=positive_int, nargs="+", default=None, help="token counts (1 8 64 128 256 512)")
  parser.add_argument("--layers", type=positive_int, default=None, help="MoE layers in the chain (8)")
  parser.add_argument("--experts", type=positive_int, default=16, help="experts per layer")
  parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token")
  parser.add_argument("--dim", type=positive_int, default=None, help="model width D (512)")
  parser.add_argument("--mlp", type=positive_int, default=None, help="expert width F (256)")
  parser.add_argument("--repeats", type=positive_int, default=None, help="timed calls per form (10)")
  add_output_flags(parser, "tokens 1 and 8, 2 layers, D 64, F 32, 2 timed calls")
  args = parser.parse_args(argv)
  if args.top_k > args.experts:
    parser.error(f"--top-k must be at most --experts={args.experts}, got {args.top_k}")
  tokens = args.tokens or ([1, 8] if args.quick else [1, 8, 64, 128, 256, 512])
  num_layers = args.layers or (2 if args.quick else 8)
  dim, mlp = args.dim or (64 if args.quick else 512), args.mlp or (32 if args.quick else 256)
  repeats = args.repeats or (2 if args.quick else 10)
  kernel = cpu_gemm.load()
  forms = list(FORMS) if kernel else ["tiled"]
  layers = make_layers(num_layers, args.experts, dim, mlp)
  rows = [row for t in tokens for row in measure(t, forms, layers, args.top_k, repeats)]
  settings = {
      "layers": num_layers,
      "experts": args.experts,
      "top_k": args.top_k,
      "dim": dim,
      "mlp": mlp,
      "repeats": repeats,
      "cpu_kernel": kernel,
      "backend": jax.default_backend(),
  }
  header = (
      f"{num_layers} MoE layers, {args.experts} experts of {dim} x {mlp}, top-{args.top_k}, fp32, best of {repeats}"
      f" calls, backend {jax.default_backend()}"
      + ("" if kernel else "; the CPU kernel is not available here (see the log), so tiled only")
  )
  emit(args.json, {"settings": settings, "results": rows}, [header, format_table(rows)])
  return 0


if __name__ == "__main__":
  sys.exit(main())
