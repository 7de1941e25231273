"""The TPU tables of docs/serving.md, compiled for TPU v5e / v6e slices on a machine without a TPU.

Three tables, each from steps compiled by libtpu for real TPU targets (`tests/upstream/tpu_compile.py`: the runner's
step with tpu-inference's kernels, abstract bfloat16 weights, the runner's caches and shardings):

- `fit`: each bundled real-size config on the smallest slice it should fit on, with the KV cache of `--max-num-seqs`
  requests at `--max-model-len` tokens: weights, cache and XLA's temporaries per chip against the chip's HBM.
- `compare`: Llama 3.1 8B and Qwen3 8B as this package's model and as tpu-inference's own JAX model, compiled for the
  same slice, shapes and sharding: HLO instructions, flops and bytes XLA counts, HBM, collectives and copies.
- `roofline`: a projected decode rate per chip from the compiled flops and the bytes a step must read (weights,
  routed experts, the batch's KV), against the chips' published peak bf16 flops and HBM bandwidth. An estimate.

Run it with the upstream tier's venv (vLLM 0.32.0, tpu-inference 0.32.0, libtpu), from the repository root:

    python=$(bash scripts/setup_upstream_env.sh) && $python scripts/tpu_report.py

`--tables fit,compare,roofline` picks tables, `--json FILE` also writes every figure. Each compile takes seconds to
a minute on a CPU (the whole run about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "upstream"), str(REPO / "tests")]  # tpu_compile, and its `support`
import stand_ins  # pylint: disable=wrong-import-position

os.environ.update(stand_ins.environment())
import tpu_compile as tc  # pylint: disable=wrong-import-position

GB = 1e9
# (config, chip, chips in the slice): the smallest slice of 4 or 8 chips whose HBM holds the bf16 weights with room
# for a cache; the 80B model's 160 GB of weights exceed 8 v5e chips (128 GB), which the table shows.
FIT_CASES = (
    ("llama3.1-8b", "v5e", 4),
    ("llama3.1-8b", "v6e", 4),
    ("qwen3-8b", "v5e", 4),
    ("qwen3-8b", "v6e", 4),
    ("gemma3-4b", "v5e", 4),
    ("gemma3-4b", "v6e", 4),
    ("qwen3.5-35b-a3b", "v5e", 8),
    ("qwen3.5-35b-a3b", "v6e", 4),
    ("qwen3-next-80b-a3b", "v5e", 8),
    ("qwen3-next-80b-a3b", "v6e", 8),
)
# Hugging Face configs of the two models tpu-inference also implements in JAX (their published config.json values).
HF_CONFIGS = {
    "llama3.1-8b": (
        "llama",
        "LlamaConfig",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "max_position_embeddings": 131072,
            "architectures": ["LlamaForCausalLM"],
        },
    ),
    "qwen3-8b": (
        "qwen3",
        "Qwen3Config",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "max_position_embeddings": 40960,
            "architectures": ["Qwen3ForCausalLM"],
        },
    ),
}


@dataclasses.dataclass
class Settings:
  """The serving shape every table uses."""

  max_model_len: int
  max_num_seqs: int
  prefill_tokens: int
  block_size: int = 16

  def run_config(self, model: str, chips: int):
    """The run's config: bfloat16, `chips`-way tensor parallelism, these serving limits."""
    # pylint: disable=import-outside-toplevel
    from maxtext.checkpoint.model_loader import load_run_config

    return load_run_config(
        model_name=model,
        dtype="bfloat16",
        weight_dtype="bfloat16",
        ici_tensor_parallelism=chips,
        max_target_length=self.max_model_len,
        max_num_seqs=self.max_num_seqs,
        block_size=self.block_size,
    )

  def num_blocks(self, model: str, chips: int) -> int:
    """The one pool's blocks for `max_num_seqs` requests at `max_model_len` tokens, each keeping in every attention
    group what a decoding request keeps there (sliding-window groups only their window's blocks), plus the null
    block: the cache a server of these limits needs."""
    # pylint: disable=import-outside-toplevel
    from maxtext.inference.engine_build import make_kv_cache_manager
    from maxtext.inference.kv_cache_capacity import request_blocks

    manager = make_kv_cache_manager(self.run_config(model, chips))
    return self.max_num_seqs * sum(request_blocks(manager, self.max_model_len).values()) + 1

  def kwargs(self, model: str, chips: int) -> dict[str, Any]:
    """`compile_step`'s keywords."""
    return {
        "num_chips": chips,
        "max_model_len": self.max_model_len,
        "max_num_seqs": self.max_num_seqs,
        "block_size": self.block_size,
        "num_blocks": self.num_blocks(model, chips),
    }


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def fit_rows(settings: Settings) -> list[dict[str, Any]]:
  """Weights, cache and temporaries per chip of a decode step and a prefill chunk, against HBM."""
  rows = []
  for model, chip, chips in FIT_CASES:
    steps, refused = {}, ""
    for step in (tc.StepShape("decode", settings.max_num_seqs), tc.StepShape("prefill", settings.prefill_tokens)):
      start = time.perf_counter()
      try:
        steps[step.name] = tc.compile_step(model, chip, chips, step, **settings.kwargs(model, chips))
      except Exception as e:  # pylint: disable=broad-exception-caught  # XLA refuses a program over HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        refused = f"{step.name}: XLA: " + str(e).split("RESOURCE_EXHAUSTED: ", 1)[-1].split(". HLO module", 1)[0]
      _log(f"fit: {model} on {chips} x {chip}, {step.name}: {time.perf_counter() - start:.0f} s")
    hbm = tc.CHIPS[chip].hbm_bytes
    worst = max(steps.values(), key=lambda r: r.peak_bytes) if steps else None
    nan = float("nan")
    rows.append(
        {
            "model": model,
            "slice": f"{chips} x {chip} ({tc.topology_name(chip, chips)})",
            "weights_gb": worst.param_bytes / GB if worst else nan,
            "cache_gb": worst.cache_bytes / GB if worst else nan,
            "temp_gb": max(r.temp_bytes + r.generated_code_bytes for r in steps.values()) / GB if steps else nan,
            "peak_gb": worst.peak_bytes / GB if worst else nan,
            "hbm_gb": hbm / GB,
            "fits": bool(worst) and not refused and worst.peak_bytes <= hbm,
            "note": refused,
        }
    )
  return rows


def compare_rows(settings: Settings, chip: str = "v6e", tp: int = 4) -> list[dict[str, Any]]:
  """This package's model and tpu-inference's own, one decode step and one prefill chunk each."""
  # pylint: disable=import-outside-toplevel
  import transformers

  rows = []
  for model, (family, config_class, values) in HF_CONFIGS.items():
    hf_config = getattr(transformers, config_class).from_dict(values)
    for step in (tc.StepShape("decode", settings.max_num_seqs), tc.StepShape("prefill", settings.prefill_tokens)):
      ours = tc.compile_step(model, chip, tp, step, **settings.kwargs(model, 4))
      with tempfile.TemporaryDirectory() as folder:
        theirs = tc.compile_upstream_step(family, hf_config, folder, chip, tp, step, **settings.kwargs(model, 4))
      _log(f"compare: {model} {step.name} compiled")
      for who, result in (("maxtext", ours), ("tpu-inference", theirs)):
        collectives = result.collectives()
        rows.append(
            {
                "model": model,
                "step": f"{step.name} ({step.num_tokens} tokens)",
                "implementation": who,
                "hlo_instructions": result.instruction_count(),
                "gflop": result.flops / 1e9,
                "gb_accessed": result.bytes_accessed / GB,
                "peak_gb": result.peak_bytes / GB,
                "all_reduce": collectives.get("all-reduce", 0) + collectives.get("all-reduce-start", 0),
                "all_gather": collectives.get("all-gather", 0) + collectives.get("all-gather-start", 0),
                "copies": collectives.get("copy", 0) + collectives.get("copy-start", 0),
            }
        )
  return rows


def _weight_bytes_read(model: str, chip: str, chips: int, batch: int) -> float:
  """Parameter bytes one chip reads in a decode step of `batch` requests: its shard of every parameter but the
  routed experts, and of those the share a batch can reach (`min(E, batch * top-k) / E`, every token routed to
  distinct experts)."""
  # pylint: disable=import-outside-toplevel
  from maxtext.checkpoint.model_loader import load_run_config
  from maxtext.models import sharding
  from maxtext.models.params import flat_param_shapes

  cfg = load_run_config(model_name=model, dtype="bfloat16", weight_dtype="bfloat16", ici_tensor_parallelism=chips)
  shardings = sharding.param_shardings(cfg, tc.slice_mesh(chip, chips, chips))
  reach = min(1.0, batch * cfg.num_experts_per_tok / cfg.num_experts) if cfg.num_experts else 1.0
  total = 0.0
  for name, leaf in flat_param_shapes(cfg).items():
    size = math.prod(shardings[name].shard_shape(tuple(leaf.shape))) * leaf.dtype.itemsize
    routed = ".moe." in f".{name}" and name.rsplit(".", 1)[-1] in (
        "gate",
        "up",
        "down",
        "gate_bias",
        "up_bias",
        "down_bias",
    )
    total += size * (reach if routed else 1.0)
  return total


def _kv_bytes_read(settings: Settings, model: str, chips: int, batch: int, context: int) -> float:
  """KV-cache bytes one chip reads in a decode step: every attention layer's keys and values of each request's
  `context` tokens, a sliding-window layer only its window's."""
  # pylint: disable=import-outside-toplevel
  from maxtext.kv_cache import kv_cache_spec

  cfg = settings.run_config(model, chips)
  total = 0.0
  for spec in kv_cache_spec.get_kv_cache_specs(cfg).values():
    if getattr(spec, "cache_kind", None) != "attention":
      continue
    tokens = min(context, spec.sliding_window or context)
    total += tokens * spec.page_size_bytes() / spec.block_size
  return batch * total / chips


def roofline_rows(settings: Settings, context: int, batches=(1, 64)) -> list[dict[str, Any]]:
  """Projected decode tokens/s per chip: step time = max(flops / peak, bytes / bandwidth) per chip."""
  rows = []
  for model, chip, chips in FIT_CASES:
    spec = tc.CHIPS[chip]
    for batch in batches:
      step = tc.StepShape("decode", max(16, batch))
      try:
        result = tc.compile_step(model, chip, chips, step, **settings.kwargs(model, chips))
      except Exception as e:  # pylint: disable=broad-exception-caught  # XLA refuses a program over HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        _log(f"roofline: {model} on {chips} x {chip} does not fit: skipped")
        break
      kv_read = _kv_bytes_read(settings, model, chips, batch, context)
      weights = _weight_bytes_read(model, chip, chips, batch)
      flops = result.flops  # per chip; the Pallas attention is opaque to XLA's count and small at decode
      seconds = max(flops / spec.bf16_flops, (weights + kv_read) / spec.hbm_bandwidth)
      rows.append(
          {
              "model": model,
              "slice": f"{chips} x {chip}",
              "batch": batch,
              "context": context,
              "weights_read_gb": weights / GB,
              "kv_read_gb": kv_read / GB,
              "gflop": flops / 1e9,
              "bound": "memory" if (weights + kv_read) / spec.hbm_bandwidth >= flops / spec.bf16_flops else "compute",
              "step_ms": seconds * 1e3,
              "tokens_per_s_per_chip": batch / seconds / chips,
          }
      )
      _log(f"roofline: {model} on {chips} x {chip}, batch {batch}")
  return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
  if not rows:
    return ""
  keys = list(rows[0])

  def cell(value: Any) -> str:
    if isinstance(value, bool):
      return "yes" if value else "**no**"
    if isinstance(value, float):
      return f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"
    return str(value)

  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  lines += ["| " + " | ".join(cell(row[k]) for k in keys) + " |" for row in rows]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--tables", default="fit,compare,roofline", help="comma-separated: fit, compare, roofline")
  parser.add_argument("--max-model-len", type=int, default=4096)
  parser.add_argument("--max-num-seqs", type=int, default=64)
  parser.add_argument("--prefill-tokens", type=int, default=1024, help="tokens of the prefill chunk compiled")
  parser.add_argument("--context", type=int, default=2048, help="tokens each decoding request has (roofline)")
  parser.add_argument("--json", type=pathlib.Path, help="also write every figure here")
  args = parser.parse_args(argv)
  tables = [t.strip() for t in args.tables.split(",") if t.strip()]
  unknown = sorted(set(tables) - {"fit", "compare", "roofline"})
  if unknown:
    parser.error(f"--tables takes fit, compare, roofline; got {', '.join(unknown)}")
  settings = Settings(args.max_model_len, args.max_num_seqs, args.prefill_tokens)
  out: dict[str, Any] = {"settings": dataclasses.asdict(settings) | {"context": args.context}}
  if "fit" in tables:
    out["fit"] = fit_rows(settings)
  if "compare" in tables:
    out["compare"] = compare_rows(settings)
  if "roofline" in tables:
    out["roofline"] = roofline_rows(settings, args.context)
  for name in tables:
    print(f"\n### {name}\n\n{_markdown(out[name])}")
  if args.json:
    args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
