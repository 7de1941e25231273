"""The hybrid allocator end to end through vLLM's own scheduler and tpu-inference's runner: a Gemma 3-like model
(12 layers, 5 sliding of window 128 : 1 full) at 4k context, once on stock tpu-inference 0.32 (every layer gets a
full-attention spec) and once with docs/tpu-inference-kv-cache-spec.patch (sliding windows declared), in the same
KV-cache bytes. The patched spec runs more requests at once, with the same greedy tokens; the speed ratio is
printed at the end of the tier (`summary`), not asserted (the tier shares its cores).

Equal bytes: stock puts all 12 layers in one KV-cache group, so one block is a page of each of 12 arrays; patched
forms 6 groups of 2 layers (the 2 full layers, 5 pairs of sliding ones) over 2 shared arrays, so one block is a page
of each of 2 arrays, and 6 times the blocks hold the same bytes. The test checks the arrays' bytes from the runner's
own layout. Every request is distinct (no prefix-cache hit between them); each reaches the 4k context. The model
runs on this package's `cpu` kernels (the pure-JAX reference kernels take minutes per run at this length).

Async scheduling is off in these runs: with it (tpu-inference's default), a request resumed after a preemption is
fed a 0 in place of its last generated token, so the stock run's preempted requests would decode differently from
the same requests unpreempted. `test_tpu_inference_feeds_a_resumed_request_a_placeholder_under_async_scheduling`
pins that fault of tpu-inference 0.32 on a small case.
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest

import serve

CONTEXT = 4096
NEW_TOKENS = 128
REQUESTS = 16
BLOCK_SIZE = 16
# Four whole requests in the stock layout, where a block spans all 12 layers; 6x the blocks of 2 layers patched.
STOCK_BLOCKS = 4 * CONTEXT // BLOCK_SIZE
PATCHED_BLOCKS = 6 * STOCK_BLOCKS
ENGINE = {
    "dtype": "float32",
    "max_model_len": CONTEXT,
    "block_size": BLOCK_SIZE,
    "max_num_seqs": REQUESTS,
    "max_num_batched_tokens": 2048,
    "enable_chunked_prefill": True,
    "async_scheduling": False,
}
FIGURES: dict[str, dict] = {}


def _main_python() -> str:
  return os.environ.get("MAXTEXT_MAIN_PYTHON", str(serve.HERE.parents[1] / ".venv" / "bin" / "python"))


def _prompts() -> list[list[int]]:
  """`REQUESTS` distinct prompts that leave room for `NEW_TOKENS` in the context."""
  length = CONTEXT - NEW_TOKENS
  return [[(37 * i + 11 * r + 3) % 500 + 1 for i in range(length)] for r in range(REQUESTS)]


@pytest.fixture(name="folder", scope="module")
def fixture_folder(tmp_path_factory) -> str:
  """The model as a Hugging Face folder (tests/hf_cases.py's `gemma3_allocator`), written in the main venv."""
  return _hf_folder(tmp_path_factory, "gemma3_allocator")


def _hf_folder(tmp_path_factory, case: str) -> str:
  """tests/hf_cases.py's `case` saved as a Hugging Face folder by transformers, in the main venv."""
  folder = tmp_path_factory.mktemp(case) / "model"
  code = (
      "import sys; sys.path.insert(0, sys.argv[3]); from hf_cases import build_hf_model;"
      " build_hf_model(sys.argv[2]).save_pretrained(sys.argv[1])"
  )
  subprocess.run(
      [_main_python(), "-c", code, str(folder), case, str(serve.HERE.parent)],
      check=True,
      timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
      stdout=subprocess.DEVNULL,
  )
  return str(folder)


@pytest.fixture(name="runs", scope="module")
def fixture_runs(folder, run_vllm) -> dict[str, dict]:
  """`{"stock": result, "patched": result}` of the same requests in the same bytes."""
  out = {}
  for name, patched, blocks in (("stock", False, STOCK_BLOCKS), ("patched", True, PATCHED_BLOCKS)):
    out[name] = run_vllm(
        folder,
        patched=patched,
        engine={**ENGINE, "num_gpu_blocks_override": blocks},
        maxtext_config={"kernel_backend": "cpu"},
        prompts=_prompts(),
        max_tokens=NEW_TOKENS,
        watch_scheduler=True,
    )
  return out


def _cache_bytes(layout: dict) -> int:
  itemsize = {"float32": 4, "bfloat16": 2}
  return sum(math.prod(shape) * itemsize[dtype] for cache in layout["kv_caches"] for shape, dtype in cache)


def _figures(result: dict) -> dict:
  seen = result["scheduler"]
  generated = sum(len(t) for t in result["tokens"])
  return {
      "groups": len(result["layout"]["groups"]),
      "blocks": result["layout"]["num_blocks"],
      "cache_bytes": _cache_bytes(result["layout"]),
      "peak_running": max(seen["running"]),
      "mean_running": sum(seen["running"]) / len(seen["running"]),
      "steps": len(seen["running"]),
      "preemptions": seen["preemptions"],
      "preempted_computed_tokens": seen["preempted_computed_tokens"],
      "generate_s": seen["generate_s"],
      "tokens_per_s": generated / seen["generate_s"],
  }


def test_the_two_layouts_hold_the_same_bytes(runs):
  stock, patched = (runs[name]["layout"] for name in ("stock", "patched"))
  assert len(stock["groups"]) == 1 and len(patched["groups"]) == 6
  assert _cache_bytes(stock) == _cache_bytes(patched)


def test_the_patched_spec_runs_more_requests_at_once_with_the_same_tokens(runs):
  stock, patched = _figures(runs["stock"]), _figures(runs["patched"])
  FIGURES.update(stock=stock, patched=patched)
  assert runs["stock"]["tokens"] == runs["patched"]["tokens"]
  assert all(len(t) == NEW_TOKENS for t in runs["patched"]["tokens"])
  assert patched["peak_running"] > stock["peak_running"]


def summary() -> list[str]:
  """The figures of both runs and the speed ratio, for the tier's closing summary (conftest.py)."""
  if len(FIGURES) < 2:
    return []
  lines = [f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()) for name, figures in FIGURES.items()]
  ratio = FIGURES["patched"]["tokens_per_s"] / FIGURES["stock"]["tokens_per_s"]
  return lines + [f"tokens/s patched / stock: {ratio:.2f}"]


# The resume fault on a small case: a 2-layer Qwen3 (tests/hf_cases.py's `qwen3_untied`), 6 requests of 480 + 32
# tokens in a pool of 64 blocks of 16 (two whole requests), so the scheduler preempts and resumes.
RESUME_CONTEXT, RESUME_NEW = 512, 32
RESUME_ENGINE = {
    "dtype": "float32",
    "max_model_len": RESUME_CONTEXT,
    "block_size": 16,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 128,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": False,
    "num_gpu_blocks_override": 64,
}


@pytest.fixture(name="resume_runs", scope="module")
def fixture_resume_runs(tmp_path_factory, run_vllm) -> dict[str, dict]:
  """`{"async": result, "sync": result, "roomy": result}`: the tight pool with async scheduling on (the default) and
  off, and a pool of 256 blocks (no preemption)."""
  folder = _hf_folder(tmp_path_factory, "qwen3_untied")
  prompts = [[(37 * i + 11 * r + 3) % 500 + 1 for i in range(RESUME_CONTEXT - RESUME_NEW)] for r in range(6)]
  engines = {
      "async": RESUME_ENGINE,
      "sync": {**RESUME_ENGINE, "async_scheduling": False},
      "roomy": {**RESUME_ENGINE, "num_gpu_blocks_override": 256},
  }
  return {
      name: run_vllm(folder, patched=False, engine=engine, prompts=prompts, max_tokens=RESUME_NEW, watch_scheduler=True)
      for name, engine in engines.items()
  }


def test_tpu_inference_feeds_a_resumed_request_a_placeholder_under_async_scheduling(resume_runs):
  # tpu-inference 0.32 rebuilds a resumed request from its own request state, whose last output token is still the
  # async-scheduling placeholder (0); vLLM 0.32 sends the request's tokens for this (`all_token_ids`), unread.
  roomy = resume_runs["roomy"]
  assert roomy["scheduler"]["preemptions"] == 0 and not roomy["resumes"]
  for name in ("async", "sync"):
    assert resume_runs[name]["scheduler"]["preemptions"] > 0 and resume_runs[name]["resumes"], name
  for resume in resume_runs["async"]["resumes"]:
    runner, scheduler = resume["runner_tokens"], resume["scheduler_tokens"]
    assert runner[:-1] == scheduler[:-1] and runner[-1] == 0 != scheduler[-1], resume["request"]
  resumed = {int(r["request"].split("-")[0]) for r in resume_runs["async"]["resumes"]}
  async_tokens, roomy_tokens = resume_runs["async"]["tokens"], roomy["tokens"]
  assert [i for i, (a, b) in enumerate(zip(async_tokens, roomy_tokens)) if a != b] == sorted(resumed)
  # Without async scheduling the runner feeds the scheduler's tokens, and every request decodes as unpreempted.
  assert all(r["runner_tokens"] == r["scheduler_tokens"] for r in resume_runs["sync"]["resumes"])
  assert resume_runs["sync"]["tokens"] == roomy_tokens
