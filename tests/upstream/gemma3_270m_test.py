"""Gemma 3 270M, the project's second real model (Q4_K_M GGUF: 18 layers, 5 sliding (window 512) : 1 full, one KV
head of 256), under vLLM 0.32.0 + tpu-inference 0.32.0's real runner, on the stock runner and with the spec patch.

The GGUF file comes from scripts/fetch_example_model.py; transformers' own GGUF loader makes it a Hugging Face folder
once (`gguf_reference.py`, cached by the file's SHA-256), and vLLM runs that folder. The prompts are the README's
and the two longer than the window (scripts/example_prompts.py), tokenized by the model's tokenizer. Three engines:
stock, patched, and patched with prefix caching (two passes over the same prompts).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

MODEL = "gemma3-270m"
MAX_TOKENS = 16
WINDOW = 512
# A server's cache: room for 2,048-token requests, prefill in chunks of 256 tokens. The runner sizes the cache from
# a fixed share of the stand-in HBM limit less the weights, so the stock and patched runners get the same bytes.
ENGINE = {
    "max_model_len": 2048,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 4,
    "num_gpu_blocks_override": None,
    "gpu_memory_utilization": 0.25,
    "skip_tokenizer_init": False,
}
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# name -> (patched, prefix caching)
RUNS = {"stock": (False, False), "patched": (True, False), "patched_prefix_caching": (True, True)}


def _load_script(name: str):
  path = REPO / "scripts" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(name="gemma3", scope="module")
def fixture_gemma3(gguf_reference) -> dict:
  """`{"folder", "sha256", "prompt_ids", "transformers"}` of the fetched GGUF file."""
  gguf = _load_script("fetch_example_model").fetch(model=MODEL)
  prompts = _load_script("example_prompts")
  return gguf_reference(str(gguf), list(prompts.README_PROMPTS[MODEL]) + list(prompts.LONG_PROMPTS), MAX_TOKENS)


def _run(name: str, gemma3: dict, run_vllm) -> dict:
  patched, prefix_caching = RUNS[name]
  prompts = [tuple(p) for p in gemma3["prompt_ids"]]
  return run_vllm(
      gemma3["folder"],
      patched=patched,
      engine={**ENGINE, "enable_prefix_caching": prefix_caching},
      prompts=(),
      rounds=(prompts, prompts) if prefix_caching else (prompts,),
      max_tokens=MAX_TOKENS,
  )


def test_the_prompts_cross_the_window(gemma3):
  lengths = [len(p) for p in gemma3["prompt_ids"]]
  assert [p[0] for p in gemma3["prompt_ids"]] == [2] * len(lengths)  # BOS first
  assert min(lengths) < WINDOW < max(lengths) and sum(n > 2 * WINDOW for n in lengths) == 1


@pytest.mark.parametrize("name", ["stock", "patched"])
def test_gemma3_270m_decodes_like_transformers(name, gemma3, run_vllm):
  """16 greedy tokens of every prompt equal transformers' float32 decode of the same folder."""
  assert _run(name, gemma3, run_vllm)["tokens"] == gemma3["transformers"]


def test_gemma3_270m_prefix_caching_gives_the_same_tokens(gemma3, run_vllm):
  """With prefix caching on, the second pass finds every full block of each prompt but the last token's (the first
  pass may find some already: the longest prompt starts with the other long one), and both passes decode what the
  run without prefix caching decodes."""
  result = _run("patched_prefix_caching", gemma3, run_vllm)
  prompts = gemma3["prompt_ids"]
  first, second = result["num_cached_tokens"][: len(prompts)], result["num_cached_tokens"][len(prompts) :]
  assert second == [(len(p) - 1) // 16 * 16 for p in prompts]
  assert first[0] == 0 and all(a <= b for a, b in zip(first, second))
  assert result["tokens"] == 2 * _run("patched", gemma3, run_vllm)["tokens"]


def _cache_bytes(layout: dict) -> int:
  return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for cache in layout["kv_caches"] for shape, dtype in cache)


def capacity(result: dict) -> tuple[int, float]:
  """(KV-cache tokens, maximum concurrency for max_model_len-token requests) as vLLM logs them."""
  found = CAPACITY.findall(result["log"])
  if len(found) != 1:
    raise AssertionError(f"expected one KV-cache capacity line in the run's log, found {len(found)}")
  tokens, request_tokens, concurrency = found[0]
  assert int(request_tokens.replace(",", "")) == ENGINE["max_model_len"]
  return int(tokens.replace(",", "")), float(concurrency)


def test_the_spec_patch_raises_capacity_at_equal_cache_bytes(gemma3, run_vllm):
  """Stock: one group, every layer a full-attention array. Patched: vLLM's six groups of three layers (5 sliding, 1
  full) in three arrays, sliding layers holding only their window; the same bytes hold more requests."""
  stock, patched = (_run(name, gemma3, run_vllm) for name in ("stock", "patched"))
  assert [len(g["layers"]) for g in stock["layout"]["groups"]] == [18] and len(stock["layout"]["kv_caches"]) == 18
  assert [len(g["layers"]) for g in patched["layout"]["groups"]] == [3] * 6
  assert [g["spec"] for g in patched["layout"]["groups"]].count("SlidingWindowSpec") == 5
  assert len(patched["layout"]["kv_caches"]) == 3
  stock_bytes, patched_bytes = _cache_bytes(stock["layout"]), _cache_bytes(patched["layout"])
  assert abs(patched_bytes - stock_bytes) <= 1e-3 * stock_bytes
  (stock_tokens, stock_concurrency), (patched_tokens, patched_concurrency) = capacity(stock), capacity(patched)
  print(f"KV cache {stock_bytes} / {patched_bytes} bytes: stock {stock_tokens} tokens, {stock_concurrency}x;")
  print(f"patched {patched_tokens} tokens, {patched_concurrency}x")
  assert patched_concurrency > stock_concurrency and patched_tokens > stock_tokens


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_through_vllm_logs_no_traceback(name, gemma3, run_vllm):
  """The whole log (stdout and stderr) of a real run, from start to the interpreter's exit, holds no traceback:
  in particular none from vLLM's engine cleanup, which walks the model's modules."""
  log = _run(name, gemma3, run_vllm)["log"]
  assert "Traceback" not in log and "Exception ignored" not in log
