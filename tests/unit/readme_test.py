"""The README's test command is exactly what CI runs; its fetch commands fetch what the example configs load."""

import importlib.util
import os
import pathlib
import re
import shlex

from maxtext.configs import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
  ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
  pytest_lines = [line.strip() for line in ci_lines if re.search(r"-m pytest\b", line) and not line.startswith("#")]
  assert len(pytest_lines) == 1, pytest_lines
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  assert pytest_lines[0] in readme.splitlines(), pytest_lines[0]
  assert "--cov-branch" in pytest_lines[0] and "--cov-fail-under=90" in pytest_lines[0]


def test_the_readme_quick_subset_runs_in_parallel_and_leaves_out_registered_markers():
  readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
  (quick,) = [line for line in readme if re.search(r"-m pytest\b", line) and '"not slow and not hf"' in line]
  assert shlex.split(quick)[1:] == ["-m", "pytest", "-q", "-n", "auto", "-m", "not slow and not hf"], quick
  markers = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
  assert '"slow: ' in markers and '"hf: ' in markers


def test_ci_runs_the_readme_upstream_tier_command():
  ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
  readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
  assert "bash scripts/upstream_tier.sh" in ci_lines and "bash scripts/upstream_tier.sh" in readme
  assert ci_lines.index("bash scripts/upstream_tier.sh") > next(i for i, l in enumerate(ci_lines) if "-m pytest" in l)


def test_readme_setup_command_installs_pinned_cpu_torch_first():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  setup = next(line for line in readme.splitlines() if line.startswith("python3 -m venv"))
  assert setup.index("torch==2.13.0") < setup.index(".[dev,hf]")


def test_readme_first_command_fetches_the_example_model_where_its_config_looks():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  setup = next(line for line in readme.splitlines() if line.startswith("python3 -m venv"))
  steps = [step.strip() for step in setup.split("&&")]
  assert steps[-2] == ".venv/bin/python scripts/fetch_example_model.py"
  decode_args = shlex.split(steps[-1])
  assert decode_args[:2] == [".venv/bin/maxtext-decode", "configs/base.yml"]
  cfg = load_config(decode_args[1:])
  assert (cfg.model_name, cfg.use_chat_template, cfg.prompt) == (
      "smollm2-135m-instruct",
      True,
      "What is the capital of France?",
  )
  fetch = _fetch_script()
  assert os.path.expanduser(cfg.gguf_model_path) == os.path.join(
      os.path.expanduser(fetch.DEFAULT_CACHE_DIR), fetch.MODELS[fetch.DEFAULT_MODEL].file_name
  )


def test_readme_gemma_command_fetches_the_file_its_config_looks_for():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  line = next(line for line in readme.splitlines() if "--model gemma3-270m &&" in line)
  fetch_step, decode_step = (shlex.split(step) for step in line.split("&&"))
  assert fetch_step == [".venv/bin/python", "scripts/fetch_example_model.py", "--model", "gemma3-270m"]
  assert decode_step[:2] == [".venv/bin/maxtext-decode", "configs/base.yml"]
  cfg = load_config(decode_step[1:])
  assert (cfg.model_name, cfg.prompt, cfg.max_new_tokens) == ("gemma3-270m", "The capital of France is", 23)
  fetch = _fetch_script()
  assert os.path.expanduser(cfg.gguf_model_path) == os.path.join(
      os.path.expanduser(fetch.DEFAULT_CACHE_DIR), fetch.MODELS["gemma3-270m"].file_name
  )


def _fetch_script():
  spec = importlib.util.spec_from_file_location("fetch_example_model", ROOT / "scripts" / "fetch_example_model.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
