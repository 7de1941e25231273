"""Runs scripts/benchmark_startup.py --quick (a random-weight tiny model) so the benchmark cannot rot, and checks
its table and its llama.cpp note without running llama.cpp."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_startup.py"


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_startup", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # fresh interpreters import JAX and compile a tiny model's steps
def test_quick_run_times_the_cli_and_the_api_from_their_spawn(capsys):
  benchmark = _load_benchmark()
  assert benchmark.main(["--quick", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["settings"]["repeats"] == 1 and report["settings"]["quick"]
  cli, api = report["results"]
  assert cli["peer"] == "maxtext-decode" and api["peer"] == "LLM API"
  # Something is on the terminal before the first token, and the constructor's share is within the process's.
  assert 0 < cli["first_err_s"] < cli["ttft_s"]
  assert 0 < api["api_ttft_s"] < api["ttft_s"]
  assert report["notes"] == ["llama.cpp skipped: --quick runs a random-weight model that has no GGUF file"]


def test_a_missing_llama_interpreter_is_named_in_the_note(tmp_path):
  available, why = _load_benchmark().llama_available(str(tmp_path / "no-venv" / "bin" / "python"))
  assert not available and "does not exist" in why and "setup_llama_cpp_env.sh" in why


def test_time_process_reads_the_first_bytes_of_stdout_and_of_the_terminal():
  benchmark = _load_benchmark()
  program = "import sys, time; sys.stderr.write('e\\n'); sys.stderr.flush(); time.sleep(0.2); print('o', flush=True)"
  run = benchmark.time_process(["python3", "-c", program], benchmark._env(), 60, kill_at_first_token=False)  # pylint: disable=protected-access
  assert run["status"] == 0 and run["stdout"] == "o\n" and run["stderr"].strip() == "e"
  assert 0 < run["first_err_s"] < run["ttft_s"] <= run["exit_s"]


def test_the_table_has_a_row_per_peer_and_the_notes():
  report = {
      "results": [
          {"peer": "maxtext-decode", "first_err_s": 0.05, "ttft_s": 1.5},
          {"peer": "LLM API", "ttft_s": 2.0, "api_ttft_s": 0.75},
      ],
      "notes": ["llama.cpp skipped: x"],
  }
  lines = _load_benchmark().format_table(report)
  assert lines[0].split() == ["peer", "first_err_s", "ttft_s", "exit_s", "api_ttft_s"]
  assert lines[1].split() == ["maxtext-decode", "0.05", "1.50", "-", "-"]
  assert lines[2].split() == ["LLM", "API", "-", "2.00", "-", "0.75"]
  assert lines[3] == "note: llama.cpp skipped: x"


@pytest.mark.parametrize(
    "model, variant, args",
    [
        (
            "smollm2",
            "float32",
            ["model_name=smollm2-135m-instruct", "prompt=What is the capital of France?", "use_chat_template=true"],
        ),
        (
            "gemma3-270m",
            "compact",
            ["model_name=gemma3-270m", "prompt=The capital of France is", "max_new_tokens=1"]
            + ["weight_dtype=bfloat16", "greedy_head_candidates=64"],
        ),
        (
            "gemma3-270m",
            "dtype=bfloat16",
            ["model_name=gemma3-270m", "prompt=The capital of France is"]
            + [
                "max_new_tokens=1",
                "dtype=bfloat16",
            ],
        ),
    ],
)
def test_model_args_are_the_readme_command_or_a_one_token_answer_with_the_variants_keys(model, variant, args):
  assert _load_benchmark().model_args(model, variant) == args


def test_an_unknown_variant_is_refused_before_any_run(capsys):
  with pytest.raises(SystemExit):
    _load_benchmark().main(["--variant", "float16"])
  assert "--variant: a maxtext variant must be one of" in capsys.readouterr().err
