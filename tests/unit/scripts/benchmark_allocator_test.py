"""scripts/benchmark_allocator.py: its pure parts, and a --quick run so the benchmark cannot rot."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_allocator.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_allocator", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_config_overrides_size_the_cache_in_bytes_and_admit_every_request_by_seqs():
  benchmark = _load_benchmark()
  keys = benchmark.config_overrides("gemma3", hybrid=False, context=4096, cache_bytes=123, requests=24, chunk=512)
  assert (keys["model_name"], keys["base_num_decoder_layers"], keys["sliding_window_size"]) == ("gemma3-tiny", 12, 128)
  assert (keys["hybrid_kv_cache"], keys["kv_cache_memory_bytes"], keys["max_target_length"]) == (False, 123, 4096)
  assert (keys["max_num_seqs"], keys["max_num_batched_tokens"]) == (24, 512)
  windowed = benchmark.config_overrides("gemma3", hybrid=True, context=64, cache_bytes=1, requests=2, chunk=8, window=32)
  assert windowed["sliding_window_size"] == 32
  qwen = benchmark.config_overrides("qwen3_5", hybrid=True, context=64, cache_bytes=1, requests=2, chunk=8, window=32)
  assert "sliding_window_size" not in qwen


def test_prompts_are_distinct_deterministic_and_in_the_vocabulary():
  benchmark = _load_benchmark()
  prompts = benchmark.make_prompts(5, 40, 512)
  assert prompts == benchmark.make_prompts(5, 40, 512)
  assert len({tuple(p) for p in prompts}) == 5 and len({p[1] for p in prompts}) == 5
  assert all(len(p) == 40 and min(p) >= 3 and max(p) < 512 for p in prompts)
  with pytest.raises(ValueError, match="need num_requests >= 1, prompt_len >= 1 and vocab_size > 3; got 0, 4, 512"):
    benchmark.make_prompts(0, 4, 512)


def test_compare_gives_the_ratios_and_the_token_check():
  benchmark = _load_benchmark()
  on = {"tokens": [[1, 2]], "admitted": 20, "tokens_per_s": 300.0}
  off = {"tokens": [[1, 2]], "admitted": 4, "tokens_per_s": 100.0}
  assert benchmark.compare(on, off) == {"same_tokens": True, "admitted_ratio": 5.0, "tokens_per_s_ratio": 3.0}
  assert not benchmark.compare(on, dict(off, tokens=[[1, 3]]))["same_tokens"]


def test_table_has_one_line_per_case():
  benchmark = _load_benchmark()
  side = {"num_blocks": 10, "admitted": 2, "preemptions": 1, "tokens_per_s": 50.0}
  row = {"model": "gemma3", "context": 4096, "cache_bytes": 400 * 2**20, "on": side, "off": side}
  row.update(same_tokens=False, admitted_ratio=1.0, tokens_per_s_ratio=1.0)
  lines = benchmark.format_table([row]).splitlines()
  assert lines[0].split()[:3] == ["model", "context", "MiB"] and len(lines) == 3
  assert lines[2].split() == ["gemma3", "4096", "400", "10/10", "2/2", "1.00", "1/1", "50/50", "1.00", "NO"]


@pytest.mark.slow
def test_quick_run_reports_both_modes_with_the_same_tokens(capsys, tmp_path):
  benchmark = _load_benchmark()
  png = tmp_path / "allocator.png"
  assert benchmark.main(["--quick", "--json", "--models", "gemma3", "--plot", str(png)]) == 0
  report = json.loads(capsys.readouterr().out)
  (row,) = report["results"]
  assert row["same_tokens"] and row["on"]["generated_tokens"] == row["off"]["generated_tokens"] == 6 * 8
  # The same 20 MiB hold 6x the blocks with 2 shared arrays as with 12 (one per layer).
  assert row["on"]["num_blocks"] == 6 * row["off"]["num_blocks"] + 2
  assert row["on"]["admitted"] >= row["off"]["admitted"] >= 1
  if report["plot"].startswith("wrote"):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--contexts", "0"], ["--contexts", "200", "--new-tokens", "256"], ["--models", "x"]])
def test_benchmark_rejects_bad_arguments(argv):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(argv)
  assert exit_info.value.code == 2
