"""Runs scripts/benchmark_memory.py in --quick mode so the benchmark cannot rot."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_memory.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_memory", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# One attention page in the gemma3 and qwen3_next tiny models: block 16 x (K and V) x 2 KV heads x head_dim 32
# padded to 128 lanes x 4 bytes (fp32) = 32 KiB.
PAGE = 16 * 2 * 2 * 128 * 4
# gpt-oss-tiny's head_dim 64 fills 64 lanes: half a page.
GPT_OSS_PAGE = 16 * 2 * 2 * 64 * 4


@pytest.mark.slow
def test_quick_run_counts_blocks_per_group_and_writes_the_plot(capsys, tmp_path):
  benchmark = _load_benchmark()
  png = tmp_path / "memory.png"
  argv = ["--quick", "--json", "--contexts", "48", "--throughput-max-context", "0", "--plot", str(png)]
  assert benchmark.main(argv) == 0
  report = json.loads(capsys.readouterr().out)
  gemma, qwen, gpt_oss, granite, bamba = report["results"]
  assert (gemma["config"], gemma["context"], qwen["config"], gpt_oss["config"]) == ("gemma3", 48, "qwen3_next", "gpt_oss")
  assert (granite["config"], bamba["config"]) == ("granite_hybrid", "bamba")
  # gemma3 (12 layers, 5:1): off, one group keeping cdiv(48, 16) = 3 blocks, each id spent in 12 arrays; on, 6 groups
  # of 2 layers in 2 arrays: the full group keeps 3 blocks, each sliding group 2 (window 32 in --quick: block 0 is out
  # of reach once 47 tokens are computed).
  assert gemma["flat_bytes_per_request"] == 3 * 12 * PAGE
  assert gemma["hybrid_bytes_per_request"] == (3 + 5 * 2) * 2 * PAGE
  assert gemma["measured_ratio"] == pytest.approx(36 / 26)
  assert gemma["theoretical_ratio"] == pytest.approx(12 * 48 / (2 * 48 + 10 * 32))
  # The budget is 64 blocks x 12 arrays: off, 63 usable blocks admit 21 requests of 3; on, 384 blocks (383 usable):
  # 29 requests hold 13 ids each (377), and a 30th needs 18 while it prefills.
  assert (gemma["flat_max_concurrent"], gemma["hybrid_max_concurrent"]) == (21, 29)
  assert gemma["flat_pooled_capacity"] == 64 * 12 * PAGE // (36 * PAGE)
  assert gemma["hybrid_pooled_capacity"] == 64 * 12 * PAGE // (26 * PAGE)
  # qwen3_next has no sliding layer: both modes keep every block (2 attention layers) plus the same GDN state.
  assert qwen["measured_ratio"] == qwen["theoretical_ratio"] == 1.0
  assert qwen["hybrid_bytes_per_request"] - 2 * 3 * PAGE == qwen["flat_bytes_per_request"] - 2 * 3 * PAGE > 0
  # gpt_oss: 2 sliding : 2 full layers; the sliding ones hold 2 blocks instead of 3.
  assert gpt_oss["flat_bytes_per_request"] == 4 * 3 * GPT_OSS_PAGE
  assert gpt_oss["hybrid_bytes_per_request"] == (2 * 3 + 2 * 2) * GPT_OSS_PAGE
  assert gpt_oss["measured_ratio"] == pytest.approx(12 / 10)
  assert gpt_oss["theoretical_ratio"] == pytest.approx(4 * 48 / (2 * 48 + 2 * 32))
  # The Mamba2 hybrids have one full attention layer and no sliding one: both modes hold its 3 blocks plus the same
  # (conv, ssm) state pair, so the ratio is 1.
  for mamba in (granite, bamba):
    assert mamba["measured_ratio"] == mamba["theoretical_ratio"] == 1.0
    assert mamba["hybrid_bytes_per_request"] == mamba["flat_bytes_per_request"] > 3 * PAGE
    assert "hybrid_decode" not in gemma and "flat_decode" not in qwen
  if report["plot"].startswith("wrote"):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  else:
    assert report["plot"].startswith("--plot skipped: matplotlib is not installed") and not png.exists()


@pytest.mark.slow
def test_quick_run_decodes_at_the_concurrency_each_mode_admits(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--json", "--configs", "gemma3", "--contexts", "40"]) == 0
  (row,) = json.loads(capsys.readouterr().out)["results"]
  for key in ("hybrid", "flat"):
    assert row[f"{key}_decode"]["requests"] == min(row[f"{key}_max_concurrent"], 2)
    assert row[f"{key}_decode"]["tokens_per_s"] > 0 and row[f"{key}_decode"]["recompilations"] == 0


def test_table_has_one_line_per_case(capsys):
  benchmark = _load_benchmark()
  argv = ["--quick", "--configs", "qwen3_next", "--contexts", "40", "--throughput-max-context", "0"]
  assert benchmark.main(argv) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].split()[:4] == ["config", "context", "hybrid_B/req", "flat_B/req"]
  assert lines[3].split()[:2] == ["qwen3_next", "40"] and lines[3].split()[-1] == "-"


@pytest.mark.parametrize("argv", [["--contexts", "0"], ["--contexts", "2", "--new-tokens", "4"], ["--configs", "x"]])
def test_benchmark_rejects_bad_arguments(argv):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(argv)
  assert exit_info.value.code == 2
