"""Runs scripts/benchmark_prefix_caching.py in --quick mode so the benchmark cannot rot, and checks its counters."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_prefix_caching.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_prefix_caching", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_quick_run_skips_the_shared_prompt_with_the_same_tokens(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--json", "--models", "qwen3-next-tiny"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["settings"]["system_tokens"] == 32 and report["settings"]["requests"] == 3
  off, on = report["results"]
  assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
  # 3 prompts of 36 tokens; without caching all are computed. With it the first computes all 36, the other two
  # resume at the last state boundary inside the 32 shared tokens (32, block size 16) and compute 4 each.
  assert off["prompt_tokens"] == on["prompt_tokens"] == off["prefill_tokens"] == 108
  assert on["prefill_tokens"] == 36 + 2 * 4
  assert off["hit_rate"] == 0.0 and on["hit_rate"] == pytest.approx(64 / 108)
  assert on["same_tokens"] is True and on["speedup"] > 0


def test_workload_shares_the_system_prompt_only():
  prompts = _load_benchmark().workload(0, 10, 3, 4)
  assert len(prompts) == 4 and all(len(p) == 13 for p in prompts)
  assert all(p[:10] == prompts[0][:10] for p in prompts)
  assert len({tuple(p[10:]) for p in prompts}) == 4


def test_a_state_block_size_that_is_not_a_multiple_is_rejected():
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(["--mamba-block-size", "24"])
  assert exit_info.value.code == 2
