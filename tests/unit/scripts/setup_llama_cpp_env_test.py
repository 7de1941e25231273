"""scripts/setup_llama_cpp_env.sh: a finished venv is reused as it is; without a usable Python it says so in one line."""

import os
import subprocess
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "setup_llama_cpp_env.sh"


_NO_AMX = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
_AMX = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8\n"
_AMX_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF"
    " -DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF"
)


def _run(venv: Path, cpuinfo: str = _NO_AMX, **env: str) -> subprocess.CompletedProcess:
  (venv.parent / "cpuinfo").write_text("processor\t: 0\n" + cpuinfo, encoding="utf-8")
  environ = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
  environ.update(MAXTEXT_LLAMA_CPP_VENV=str(venv), MAXTEXT_CPUINFO=str(venv.parent / "cpuinfo"), **env)
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


def test_on_a_cpu_with_amx_a_venv_built_natively_is_rebuilt_without_amx(tmp_path):
  venv = tmp_path / "venv"
  venv.mkdir()
  (venv / ".maxtext-complete").touch()  # a native build (no options): its AMX buffer type crashes on Q4_1 weights
  result = _run(venv, _AMX, PYTHON3="/nonexistent/python3")
  assert result.returncode == 3 and "no Python 3.9+ found" in result.stderr  # it set out to rebuild
  (venv / ".maxtext-complete").write_text(_AMX_ARGS, encoding="utf-8")
  result = _run(venv, _AMX, PYTHON3="/nonexistent/python3")
  assert result.returncode == 0 and result.stdout == f"{venv}/bin/python\n" and result.stderr == ""
  assert _run(venv, _AMX, CMAKE_ARGS="-DGGML_NATIVE=ON", PYTHON3="/nonexistent/python3").returncode == 3  # user's
