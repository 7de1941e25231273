"""The README's test command is exactly what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
  ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
  pytest_lines = [line.strip() for line in ci_lines if re.search(r"-m pytest\b", line) and not line.startswith("#")]
  assert len(pytest_lines) == 1, pytest_lines
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  assert pytest_lines[0] in readme.splitlines(), pytest_lines[0]
  assert "--cov-branch" in pytest_lines[0] and "--cov-fail-under=90" in pytest_lines[0]


def test_readme_setup_command_installs_pinned_cpu_torch_first():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  setup = next(line for line in readme.splitlines() if line.startswith("python3 -m venv"))
  assert setup.index("torch==2.13.0") < setup.index(".[dev,hf]")
