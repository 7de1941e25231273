"""Runs scripts/benchmark_remap.py in-process on a tiny case so the benchmark cannot rot."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_remap.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_remap", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_benchmark_json_reports_every_case_with_equal_program_sizes(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--layers", "8", "--repeats", "2", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  results = report["results"]
  assert report["repeats"] == 2
  assert [(row["layers"], row["layout"]) for row in results] == [
      (8, layout) for layout in ("direct", "identity", "hybrid", "shuffled")
  ]
  assert len({(row["jaxpr_eqns"], row["hlo_instructions"]) for row in results}) == 1
  assert all(row["compile_s"] > 0 and row["step_ms_min"] <= row["step_ms_mean"] for row in results)


@pytest.mark.slow
def test_quick_json_runs_every_layout_at_8_layers(capsys):
  assert _load_benchmark().main(["--quick", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["repeats"] == 2 and [row["layers"] for row in report["results"]] == [8] * 4


@pytest.mark.slow
def test_benchmark_table(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--layers", "4", "--layouts", "hybrid", "--repeats", "1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].split() == ["layers", "layout", "jaxpr_eqns", "hlo_instr", "compile_s", "step_ms", "min_ms"]
  assert lines[3].split()[:2] == ["4", "hybrid"]


def test_benchmark_layouts():
  benchmark = _load_benchmark()
  assert benchmark.layout_slots("identity", 8, 0) == (0, 1, 2, 3, 4, 5, 6, 7)
  # GDN layers 0-2 and 4-6 take slots 0-5; attention layers 3 and 7 take slots 6 and 7.
  assert benchmark.layout_slots("hybrid", 8, 0) == (0, 1, 2, 6, 3, 4, 5, 7)
  shuffled = benchmark.layout_slots("shuffled", 48, 0)
  assert sorted(shuffled) == list(range(48)) and shuffled != tuple(range(48))


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--repeats", "0"], ["--layouts", "diagonal"]])
def test_benchmark_rejects_bad_arguments(argv):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(argv)
  assert exit_info.value.code == 2
