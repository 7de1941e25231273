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


def test_config_overrides_size_the_cache_in_bytes_and_set_the_scheduler_keys_of_the_cell():
  benchmark = _load_benchmark()
  keys = benchmark.config_overrides("gemma3", hybrid=False, context=4096, cache_bytes=123, max_num_seqs=24, chunk=512)
  assert (keys["model_name"], keys["base_num_decoder_layers"], keys["sliding_window_size"]) == ("gemma3-tiny", 12, 128)
  assert (keys["hybrid_kv_cache"], keys["kv_cache_memory_bytes"], keys["max_target_length"]) == (False, 123, 4096)
  assert (keys["max_num_seqs"], keys["max_num_batched_tokens"]) == (24, 512)
  assert (keys["admission_reserve"], keys["enable_prefix_caching"]) == ("none", True)
  windowed = benchmark.config_overrides(
      "gemma3",
      hybrid=True,
      context=64,
      cache_bytes=1,
      max_num_seqs=2,
      chunk=8,
      reserve="max_tokens",
      prefix_caching=False,
      window=32,
  )
  assert windowed["sliding_window_size"] == 32
  assert (windowed["admission_reserve"], windowed["enable_prefix_caching"]) == ("max_tokens", False)
  qwen = benchmark.config_overrides("qwen3_5", hybrid=True, context=64, cache_bytes=1, max_num_seqs=2, chunk=8, window=32)
  assert "sliding_window_size" not in qwen


def test_the_default_sweep_is_the_issue_s_grid_and_quick_is_one_small_cell():
  benchmark = _load_benchmark()
  args = benchmark.parse_args([])
  assert (args.contexts, args.chunks, args.max_num_seqs) == ([2048, 4096, 8192], [512, 2048], [24, 64])
  assert (args.models, args.admission_reserve, args.prefix_caching, args.requests) == (["gemma3"], ["none"], "on", 64)
  cells = benchmark.cells(args)
  assert len(cells) == 12 and cells[0] == {
      "model": "gemma3",
      "context": 2048,
      "chunk": 512,
      "max_num_seqs": 24,
      "reserve": "none",
  }
  assert cells[-1] == {"model": "gemma3", "context": 8192, "chunk": 2048, "max_num_seqs": 64, "reserve": "none"}
  both = benchmark.parse_args(["--admission-reserve", "none", "max_tokens", "--contexts", "4096"])
  assert [c["reserve"] for c in benchmark.cells(both)] == ["none", "max_tokens"] * 4
  quick = benchmark.parse_args(["--quick"])
  assert len(benchmark.cells(quick)) == 1 and (quick.requests, quick.new_tokens) == (6, 8)


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


def test_table_has_one_line_per_cell():
  benchmark = _load_benchmark()
  on = {"num_blocks": 60, "admitted": 8, "preemptions": 0, "recomputed_tokens": 0, "steps": 90, "tokens_per_s": 150.0}
  off = {"num_blocks": 10, "admitted": 2, "preemptions": 3, "recomputed_tokens": 4096, "steps": 300, "tokens_per_s": 50.0}
  row = {"model": "gemma3", "context": 4096, "chunk": 512, "max_num_seqs": 24, "reserve": "max_tokens"}
  row.update(cache_bytes=400 * 2**20, on=on, off=off, same_tokens=False, admitted_ratio=4.0, tokens_per_s_ratio=3.0)
  lines = benchmark.format_table([row]).splitlines()
  assert lines[0].split()[:6] == ["model", "context", "chunk", "seqs", "reserve", "MiB"] and len(lines) == 3
  assert lines[2].split() == [
      "gemma3",
      "4096",
      "512",
      "24",
      "max_tokens",
      "400",
      "60/10",
      "8/2",
      "4.00",
      "0/3",
      "0/4096",
      "90/300",
      "150/50",
      "3.00",
      "NO",
  ]


@pytest.mark.slow
def test_quick_run_reports_both_modes_with_the_same_tokens(capsys, tmp_path):
  benchmark = _load_benchmark()
  png = tmp_path / "allocator.png"
  assert benchmark.main(["--quick", "--json", "--models", "gemma3", "--plot", str(png)]) == 0
  report = json.loads(capsys.readouterr().out)
  (row,) = report["results"]
  assert (row["context"], row["chunk"], row["max_num_seqs"], row["reserve"]) == (256, 512, 6, "none")
  assert row["same_tokens"] and row["on"]["generated_tokens"] == row["off"]["generated_tokens"] == 6 * 8
  # The same 20 MiB hold 6x the blocks with 2 shared arrays as with 12 (one per layer).
  assert row["on"]["num_blocks"] == 6 * row["off"]["num_blocks"] + 2
  assert row["on"]["admitted"] >= row["off"]["admitted"] >= 1
  assert 0 < row["on"]["steps"] <= row["off"]["steps"]
  if report["plot"].startswith("wrote"):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--contexts", "0"], "must be a positive integer, got 0"),
        (["--contexts", "200", "--new-tokens", "256"], "--contexts must exceed --new-tokens"),
        (["--models", "x"], "invalid choice: 'x'"),
        (["--admission-reserve", "all"], "invalid choice: 'all'"),
        (["--chunks", "32", "--max-num-seqs", "64"], "got chunk 32 and max_num_seqs 64"),
    ],
)
def test_benchmark_rejects_bad_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(argv)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err
