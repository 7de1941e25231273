"""Runs scripts/benchmark_decode.py in --quick mode (this package and transformers) so the benchmark cannot rot."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_decode.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_decode", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.hf
@pytest.mark.slow
def test_quick_run_reports_every_model_peer_and_batch_with_transformers_tokens(capsys):
  benchmark = _load_benchmark()
  src = str(_SCRIPT.parents[1] / "src")  # this tree as its own baseline: the same tokens
  assert benchmark.main(["--quick", "--json", "--peers", "maxtext", "transformers", "--baseline-src", src]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["settings"] == {
      "baseline_src": src,
      "batches": [1, 2],
      "prompt_len": 8,
      "new_tokens": 4,
      "repeats": 1,
      "paired_rounds": 2,
      "maxtext_variants": {"maxtext": []},
  }
  probes = report["bandwidth"]["probes_gb_per_s"]
  assert len(probes) == 4 and min(probes) > 0  # before the first checkpoint and after each of the three
  assert report["bandwidth"]["gb_per_s"] == max(probes)
  rows = report["results"]
  baseline = benchmark.BASELINE
  # The baseline runs before this tree for the first checkpoint, after it for the second, and so on.
  orders = {"llama": (baseline, "maxtext"), "gemma3": ("maxtext", baseline), "qwen3_next": (baseline, "maxtext")}
  assert [(r["model"], r["peer"], r["batch"]) for r in rows] == [
      (model, peer, batch)
      for model in ("llama", "gemma3", "qwen3_next")
      for peer in orders[model] + ("transformers",)
      for batch in (1, 2)
  ]
  for row in rows:
    if row["peer"] == baseline:
      assert row["tokens_per_s"] > 0 and row["same_tokens_as_reference"] == 1.0
      assert "ratio_to_baseline" not in row and "ratio_to_best_peer" not in row
      continue
    assert row["tokens_per_s"] > 0 and row["first_call_s"] > 0 and 0 < row["roofline_share"]
    # Same seeded checkpoint and prompts, greedy: this package must pick transformers' tokens.
    assert row["reference"] == "transformers" and row["same_tokens_as_reference"] == 1.0, row
    if row["peer"] == "maxtext":
      assert row["recompilations"] == 0 and row["ratio_to_best_peer"] > 0
      assert row["ratio_to_baseline"] > 0 and row["same_tokens_as_baseline"] == 1.0
      # The warm start: a second process over the first one's compilation cache, the same tokens.
      assert row["warm_error"] is None and row["warm_load_s"] > 0 and row["warm_first_call_s"] > 0
      assert row["warm_same_tokens"] == 1.0
      # 4 new tokens: 3 pure-decode steps per call; a decode step is faster than a whole call per token.
      assert 0 < row["decode_step_s"] and row["decode_step_roofline_share"] > row["roofline_share"] * 0.5
      # Two paired rounds, each with its own reading of the bandwidth in this process.
      assert len(row["paired_gb_per_s"]) == 2 and min(row["paired_gb_per_s"]) > 0
      assert row["paired_step_roofline_share"] > 0
    else:
      assert row["recompilations"] is None and "ratio_to_best_peer" not in row
      assert row["decode_step_s"] is None and row["decode_step_roofline_share"] is None
      assert row["paired_step_roofline_share"] is None and row["paired_gb_per_s"] is None


def test_active_experts_and_weight_bytes():
  benchmark = _load_benchmark()
  assert benchmark.expected_active_experts(16, 2, 1) == pytest.approx(2.0)
  # 8 tokens x top-2 of 16, uniform: 16 * (1 - (14/16)^8) = 10.25...
  assert benchmark.expected_active_experts(16, 2, 8) == pytest.approx(16 * (1 - 0.875**8))
  tensors = {
      "model.embed_tokens.weight": 1000,
      "model.layers.0.mlp.experts.gate_up_proj": 160,
      "model.layers.0.self_attn.q_proj.weight": 30,
      "lm_head.weight": 1000,
  }
  untied = {"num_experts": 16, "num_experts_per_tok": 2, "tie_word_embeddings": False}
  assert benchmark.active_weight_bytes(tensors, untied, 1) == pytest.approx(30 + 1000 + 160 * 2 / 16)
  dense_tied = {"tie_word_embeddings": True}
  assert benchmark.active_weight_bytes({"model.embed_tokens.weight": 1000, "x": 5}, dense_tied, 8) == 1005


def test_table_marks_peers_that_did_not_run():
  benchmark = _load_benchmark()
  rows = [
      {
          "model": "llama",
          "peer": "maxtext",
          "batch": 1,
          "tokens_per_s": 50.0,
          "load_s": 1.0,
          "first_call_s": 2.0,
          "recompilations": 0,
          "roofline_share": 0.25,
          "decode_step_s": 0.0125,
          "decode_step_roofline_share": 0.5,
          "paired_step_roofline_share": 0.75,
          "same_tokens_as_reference": 1.0,
          "ratio_to_best_peer": 0.5,
          "warm_load_s": 0.5,
          "warm_first_call_s": 0.75,
      },
      {
          "model": "llama",
          "peer": "maxtext",
          "batch": 8,
          "tokens_per_s": 50.0,
          "load_s": 1.0,
          "first_call_s": 2.0,
          "recompilations": 0,
          "roofline_share": 0.25,
          "same_tokens_as_reference": 1.0,
          "warm_error": "exit status 1: no cache",
      },
      {"model": "llama", "peer": "vllm", "batch": None, "error": "exit status 1: boom"},
      {
          "model": "llama",
          "peer": "transformers",
          "batch": 1,
          "tokens_per_s": 60.0,
          "load_s": 1.0,
          "first_call_s": 2.0,
          "recompilations": None,
          "roofline_share": 0.3,
          "same_tokens_as_reference": 1.0,
      },
  ]
  lines = benchmark.format_table(rows).splitlines()
  assert lines[0].split() == ["model", "peer", "batch", "tok/s", "vs", "best", "load_s", "first_s", "wload_s"] + [
      "wfirst_s",
      "recomp",
      "roofline",
      "step_ms",
      "step_rf",
      "pair_rf",
      "same",
      "vs",
      "base",
      "=base",
  ]
  assert lines[2].split() == ["llama", "maxtext", "1", "50.0", "0.50", "1.00", "2.00", "0.50", "0.75", "0"] + [
      "0.25",
      "12.50",
      "0.50",
      "0.75",
      "1.00",
      "-",
      "-",
  ]
  assert lines[3].split()[:9] == ["llama", "maxtext", "8", "50.0", "-", "1.00", "2.00", "-", "-"]
  assert lines[4].split() == ["llama", "maxtext", "warm", "start", "not", "run:", "exit", "status", "1:", "no", "cache"]
  assert lines[5].split()[:4] == ["llama", "vllm", "not", "run:"] and lines[5].endswith("boom")
  assert lines[6].split()[:9] == ["llama", "transformers", "1", "60.0", "-", "1.00", "2.00", "-", "-"]


def test_decode_step_timer_keeps_only_steps_that_sample_every_scheduled_token():
  benchmark = _load_benchmark()

  class Engine:
    """Steps through a plan of (scheduled, sampled) token counts like the engine's counters."""

    def __init__(self):
      self.stats = types.SimpleNamespace(scheduled_tokens=0, generated_tokens=0)
      self.plan = [(64, 1), (1, 1), (8, 8), (5, 0)]  # prefill + first token, decode, 8 decodes, chunk without sample

    def step(self):
      """One planned step."""
      scheduled, generated = self.plan.pop(0)
      self.stats.scheduled_tokens += scheduled
      self.stats.generated_tokens += generated
      return []

  engine = Engine()
  times = benchmark.peers_module.time_decode_steps(engine)
  for _ in range(4):
    assert not engine.step()
  assert len(times) == 2 and all(t >= 0 for t in times)


def _peer(tokens_per_s, tokens):
  """A worker's result for batch 1: its tokens/s and tokens."""
  stats = {"first_call_s": 2.0, "generate_s": 0.5, "tokens_per_s": tokens_per_s, "tokens": tokens}
  return {"load_s": 1.0, "batches": {"1": stats}}


def test_the_baseline_tree_is_compared_with_this_one_and_is_no_peer_to_beat():
  """`--baseline-src`'s rows: this tree's tokens/s over the baseline's and whether their tokens agree; the baseline
  does not count as the best other peer."""
  benchmark = _load_benchmark()
  checkpoint = {"tensor_bytes": {"model.embed_tokens.weight": 4000, "model.layers.0.mlp.up_proj.weight": 1000}}
  hf_config = {"num_hidden_layers": 1, "tie_word_embeddings": False}
  peers = {
      benchmark.BASELINE: _peer(40.0, [[1, 2], [3, 4]]),
      "maxtext": _peer(50.0, [[1, 2], [3, 5]]),
      "transformers": _peer(100.0, [[1, 2], [3, 4]]),
  }
  rows = {row["peer"]: row for row in benchmark.summarize("llama", checkpoint, hf_config, peers, gb_per_s=10.0)}
  assert rows["maxtext"]["ratio_to_baseline"] == pytest.approx(1.25)
  assert rows["maxtext"]["same_tokens_as_baseline"] == 0.5
  assert rows["maxtext"]["ratio_to_best_peer"] == pytest.approx(0.5)  # transformers', not the baseline's
  assert "ratio_to_baseline" not in rows[benchmark.BASELINE] and "ratio_to_best_peer" not in rows[benchmark.BASELINE]
  line = benchmark.format_table([rows["maxtext"]]).splitlines()[2]
  assert line.split()[-2:] == ["1.25", "0.50"]


def test_a_baseline_src_without_the_package_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(["--baseline-src", str(tmp_path)])
  assert exit_info.value.code == 2
  assert f"--baseline-src {tmp_path}: must be a src/ folder holding the maxtext package" in capsys.readouterr().err


def test_a_worker_runs_with_the_given_source_tree_first_on_its_path(tmp_path):
  env = _load_benchmark()._env(str(tmp_path))  # pylint: disable=protected-access
  assert env["PYTHONPATH"].split(":")[0] == str(tmp_path)
  default = _load_benchmark()._env()  # pylint: disable=protected-access
  assert default["PYTHONPATH"].split(":")[0] == str(_SCRIPT.parents[1] / "src")


@pytest.mark.parametrize("module", ["vllm", "llama_cpp"])
def test_a_peer_is_reported_missing_from_an_interpreter_without_it(module):
  ok, why = _load_benchmark().peer_available(sys.executable, module)
  assert not ok and module in why


@pytest.mark.parametrize(
    "argv", [["--batches", "0"], ["--peers", "tgi"], ["--models", "gpt2"], ["--maxtext-variants", "float16"]]
)
def test_benchmark_rejects_bad_arguments(argv):
  with pytest.raises(SystemExit) as exit_info:
    _load_benchmark().main(argv)
  assert exit_info.value.code == 2


def test_paired_share_is_the_median_of_the_rounds_against_their_own_bandwidth():
  """Each round's step against the bandwidth read around it: 1 MB at 1 GB/s is 1 ms of reading."""
  benchmark = _load_benchmark()
  checkpoint = {"tensor_bytes": {"model.layers.0.self_attn.q_proj.weight": 1_000_000}}
  stats = {
      "generate_s": 0.04,
      "tokens": [[5] * 4],
      "tokens_per_s": 100.0,
      "first_call_s": 1.0,
      "decode_step_s": 0.004,
      # shares 1 ms / 4 ms, (0.5 ms) / 2 ms, (0.25 ms) / 0.5 ms: 0.25, 0.25, 0.5 -> median 0.25
      "paired": [
          {"gb_per_s": 1.0, "decode_step_s": 0.004},
          {"gb_per_s": 2.0, "decode_step_s": 0.002},
          {"gb_per_s": 4.0, "decode_step_s": 0.0005},
      ],
  }
  peers = {"maxtext": {"load_s": 1.0, "batches": {"1": stats}}}
  (row,) = benchmark.summarize("llama", checkpoint, {"tie_word_embeddings": True}, peers, 2.0)
  assert row["paired_step_roofline_share"] == pytest.approx(0.25)
  assert row["paired_gb_per_s"] == [1.0, 2.0, 4.0]
  assert row["decode_step_roofline_share"] == pytest.approx(0.5e-3 / 0.004)  # against the run's 2 GB/s


def test_the_gguf_model_compares_variants_with_float32_and_has_no_roofline():
  """smollm2's rows: `same` against this package's float32 tokens, `vs best` of every variant against llama.cpp,
  no roofline (the checkpoint has no tensor sizes), a variant whose key the config refused is one row of its own."""
  benchmark = _load_benchmark()
  peers = {
      "maxtext": _peer(50.0, [[1, 2, 3]]),
      "maxtext:int8w": _peer(80.0, [[1, 2, 4]]),
      "maxtext:bfloat16": {"error": "exit status 1: ConfigError: unknown key quantization"},
      benchmark.LLAMA_CPP: _peer(64.0, [[1, 2, 3]]),
  }
  rows = {row["peer"]: row for row in benchmark.summarize("smollm2", {"prompt_ids": [1]}, {}, peers, 10.0, "maxtext")}
  assert rows["maxtext"]["same_tokens_as_reference"] == 1.0 and rows["maxtext:int8w"]["same_tokens_as_reference"] == 0
  assert rows[benchmark.LLAMA_CPP]["same_tokens_as_reference"] == 1.0
  assert all(rows[p]["reference"] == "maxtext" for p in ("maxtext", "maxtext:int8w", benchmark.LLAMA_CPP))
  assert rows["maxtext"]["ratio_to_best_peer"] == pytest.approx(50 / 64)
  assert rows["maxtext:int8w"]["ratio_to_best_peer"] == pytest.approx(80 / 64)
  assert "ratio_to_best_peer" not in rows[benchmark.LLAMA_CPP]
  assert rows["maxtext"]["roofline_share"] is None and rows["maxtext"]["decode_step_roofline_share"] is None
  lines = benchmark.format_table([rows["maxtext:int8w"], rows["maxtext:bfloat16"]]).splitlines()
  assert lines[2].split()[:5] == ["smollm2", "maxtext:int8w", "1", "80.0", "1.25"] and lines[2].split()[10] == "-"
  assert lines[3].endswith("not run: exit status 1: ConfigError: unknown key quantization")


@pytest.mark.parametrize(
    "job, kind, error",
    [
        ("llamacpp", "GGUF", "llamacpp runs the GGUF models only"),
        ("vllm", "random", "vllm runs the random checkpoints only"),
    ],
)
def test_a_peer_that_cannot_run_a_model_is_a_row_without_a_worker(job, kind, error):
  run_job = _load_benchmark()._run_job  # pylint: disable=protected-access
  assert run_job(job, kind, [], {}, [], {}, 1.0) == {"error": error}


def _llama_python() -> str:
  """The llama.cpp venv's interpreter when scripts/setup_llama_cpp_env.sh built it, else this one (then the peer is
  reported missing)."""
  venv = Path.home() / ".cache" / "maxtext" / "llama-cpp-python-0.3.36"
  return str(venv / "bin" / "python") if (venv / ".maxtext-complete").is_file() else sys.executable


@pytest.mark.slow
def test_quick_run_on_the_example_model_runs_each_variant_and_fails_an_unknown_key_alone(example_gguf, capsys):
  del example_gguf  # fetched once; the benchmark finds it in the same cache
  benchmark = _load_benchmark()
  python = _llama_python()
  argv = ["--quick", "--json", "--models", "smollm2", "--peers", "maxtext", "llamacpp", "--llama-python", python]
  argv += ["--maxtext-variants", "float32", "bfloat16", "no_such_key=1", "--paired-rounds", "1"]
  assert benchmark.main(argv) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["settings"]["maxtext_variants"] == {
      "maxtext": [],
      "maxtext:bfloat16": ["weight_dtype=bfloat16"],
      "maxtext:no_such_key=1": ["no_such_key=1"],
  }
  assert "through the chat template" in report["notes"]["smollm2"]
  rows = {(r["peer"], r["batch"]): r for r in report["results"]}
  assert "no_such_key" in rows[("maxtext:no_such_key=1", None)]["error"]
  for peer in ("maxtext", "maxtext:bfloat16") + (("llamacpp",) if python != sys.executable else ()):
    for batch in (1, 2):
      row = rows[(peer, batch)]
      assert row["tokens_per_s"] > 0 and row["roofline_share"] is None and row["reference"] == "maxtext"
      assert 0 <= row["same_tokens_as_reference"] <= 1
  assert rows[("maxtext", 1)]["same_tokens_as_reference"] == 1.0 and rows[("maxtext", 1)]["recompilations"] == 0
  assert rows[("maxtext", 2)]["warm_same_tokens"] == 1.0
  if python == sys.executable:
    assert "llama_cpp" in report["notes"]["llamacpp"] and not any(peer == "llamacpp" for peer, _ in rows)
  else:
    assert "batch N = N sequences" in report["notes"]["llamacpp"]
