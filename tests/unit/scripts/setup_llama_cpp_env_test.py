"""scripts/setup_llama_cpp_env.sh: a finished venv is reused as it is; without a usable Python it says so in one line."""

import os
import subprocess
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "setup_llama_cpp_env.sh"


def _run(venv: Path, **env: str) -> subprocess.CompletedProcess:
  environ = dict(os.environ, MAXTEXT_LLAMA_CPP_VENV=str(venv), **env)
  return subprocess.run(["bash", str(_SCRIPT)], env=environ, capture_output=True, text=True, timeout=60, check=False)


def test_a_finished_venv_is_reused_without_building(tmp_path):
  venv = tmp_path / "venv"
  venv.mkdir()
  (venv / ".maxtext-complete").touch()
  result = _run(venv, PYTHON3="/nonexistent/python3")  # a build would need it and fail
  assert result.returncode == 0 and result.stdout == f"{venv}/bin/python\n" and result.stderr == ""


def test_without_a_usable_python_it_exits_3_with_one_line_and_builds_nothing(tmp_path):
  venv = tmp_path / "venv"
  result = _run(venv, PYTHON3="/nonexistent/python3")
  assert result.returncode == 3 and result.stdout == ""
  assert result.stderr.splitlines() == [
      "llama.cpp peer: no Python 3.9+ found (set $PYTHON3 or put python3 on PATH; got '/nonexistent/python3')"
  ]
  assert not venv.exists()
