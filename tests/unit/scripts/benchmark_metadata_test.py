"""Runs scripts/benchmark_metadata.py in --quick mode so the benchmark cannot rot, and checks its counter."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_metadata.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_metadata", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_quick_run_compares_grouped_and_per_layer_metadata(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["settings"]["layers"] == 12 and report["settings"]["repeats"] == 2
  grouped, per_layer = report["results"]
  assert (grouped["mode"], per_layer["mode"]) == ("grouped", "per_layer")
  # 5 array fields (positions, block tables, seq lens, query starts, distribution). vLLM's grouping splits each
  # layer type into groups of the smallest type's size: the 2 full-attention layers of 12 (5:1) make groups of two
  # layers, so 6 groups vs 12 layers.
  assert grouped["metadata_leaves"] == 6 * 5 and per_layer["metadata_leaves"] == 12 * 5
  # Tracing does the same work per layer either way; only the compiler can share work between equal inputs.
  assert grouped["jaxpr_eqns"] == per_layer["jaxpr_eqns"] and grouped["metadata_eqns"] == per_layer["metadata_eqns"]
  assert 0 < grouped["metadata_eqns"] < grouped["jaxpr_eqns"]
  assert grouped["hlo_instructions"] < per_layer["hlo_instructions"]
  assert all(row["compile_s"] > 0 and row["step_ms_min"] <= row["step_ms_mean"] for row in (grouped, per_layer))


def test_metadata_equations_are_those_fed_by_metadata_and_constants_only():
  benchmark = _load_benchmark()
  inner = jax.jit(lambda m: m * 3)

  def f(md, x):
    derived = inner(md + 1)  # metadata only: add, and the jitted mul
    return jnp.sum(derived) * x, jnp.sin(x)  # sum is metadata only; the product and sin are not

  closed = jax.make_jaxpr(f)(jnp.ones(4, jnp.int32), jnp.float32(2.0))
  count, out_kinds = benchmark.count_metadata_equations(closed, [benchmark.META, benchmark.OTHER])
  assert count == 4  # add, the jitted mul, reduce_sum, convert_element_type
  assert out_kinds == [benchmark.OTHER, benchmark.OTHER]


def test_benchmark_rejects_layers_that_are_not_a_multiple_of_six():
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(["--layers", "8"])
  assert exit_info.value.code == 2
