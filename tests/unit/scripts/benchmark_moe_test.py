"""Runs scripts/benchmark_moe.py in --quick mode so the benchmark cannot rot, and checks what it reports."""

import importlib.util
import json
from pathlib import Path

import pytest

from maxtext.kernels.cpu import cpu_gemm

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_moe.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_moe", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_quick_run_times_both_forms_and_they_agree(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  settings = report["settings"]
  assert (settings["layers"], settings["dim"], settings["mlp"], settings["repeats"]) == (2, 64, 32, 2)
  forms = ["tiled", "cpu_rows"] if cpu_gemm.unsupported_reason() is None else ["tiled"]
  assert settings["cpu_kernel"] is (len(forms) == 2)
  assert [(row["tokens"], row["form"]) for row in report["results"]] == [(t, f) for t in (1, 8) for f in forms]
  for row in report["results"]:
    assert row["compile_s"] > 0 and 0 < row["best_ms"] <= row["median_ms"]
    assert row["max_rel_diff"] < 1e-5  # the same experts, summed in another order
    if row["form"] == "tiled":
      assert row["vs_tiled"] == 1.0 and row["max_rel_diff"] == 0.0


def test_the_table_has_a_row_per_form_and_token_count(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--tokens", "3"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("2 MoE layers, 16 experts of 64 x 32, top-2, fp32, best of 2 calls")
  assert out[1].split() == ["tokens", "form", "compile_s", "best_ms", "median_ms", "vs_tiled", "rel_diff"]
  assert [line.split()[:2] for line in out[3:]] == [["3", "tiled"]] + (
      [["3", "cpu_rows"]] if cpu_gemm.unsupported_reason() is None else []
  )


def test_top_k_above_the_expert_count_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(["--experts", "2", "--top-k", "3"])
  assert exit_info.value.code == 2
  assert "--top-k must be at most --experts=2, got 3" in capsys.readouterr().err
