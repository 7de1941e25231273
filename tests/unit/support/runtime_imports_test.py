"""The runtime never imports the tests' `support` package (tests/support/): the fakes, checks and wheel fetcher there
are for tests and scripts only, and the wheel does not hold them (`tests/unit/wheel_test.py`)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from support.imports import imported_modules

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC = ROOT / "src"
SUPPORT = ROOT / "tests" / "support"
RUNTIME_ENTRY_POINTS = (
    "maxtext.decode",
    "maxtext.decode_run",
    "maxtext.inference",
    "maxtext.inference.llm",
    "maxtext.checkpoint",
    "maxtext.integration.vllm.adapter",
    "maxtext.integration.vllm.plugin",
)
# Imports every entry point, then runs the CLI's cheapest complete path (a dry run builds the config and the
# KV-cache manager) and one `LLM.generate` of two tokens, so imports made inside functions count too.
_PROGRAM = """
import importlib, json, sys
for name in {names!r}:
  importlib.import_module(name)
from maxtext import decode
from maxtext.inference import LLM, SamplingParams
status = decode.main(["model_name=llama-tiny", "dry_run=true"])
llm = LLM(model_name="llama-tiny", compilation_cache_dir="", background_compile=False, max_target_length=16)
tokens = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
print(json.dumps({{"status": status, "tokens": len(tokens), "modules": sorted(sys.modules)}}))
"""


@pytest.mark.slow  # a fresh interpreter imports JAX and compiles a tiny model's step
def test_the_runtime_entry_points_import_no_support_module():
  # `support` is importable in the child (tests/ on its path), so an import of it would succeed and be seen.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run(
      [sys.executable, "-c", _PROGRAM.format(names=RUNTIME_ENTRY_POINTS)],
      capture_output=True,
      text=True,
      env=env,
      check=False,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["status"] == 0 and report["tokens"] == 2
  assert set(RUNTIME_ENTRY_POINTS) <= set(report["modules"])  # the program did import what it names
  assert [m for m in report["modules"] if _is_support(m)] == []


def _is_support(module: str) -> bool:
  return module.split(".")[0] == "support"


def test_no_runtime_module_names_the_support_package():
  # Static, so an import inside a branch the program above does not reach is caught as well.
  offenders = {}
  for path in sorted((SRC / "maxtext").rglob("*.py")):
    bad = sorted(m for m in imported_modules(path) if _is_support(m))
    if bad:
      offenders[str(path.relative_to(SRC))] = bad
  assert not offenders
  # The walk does see the package's imports (a parser that found nothing would pass the check above).
  assert "support.kv_cache_checks" not in imported_modules(SRC / "maxtext" / "inference" / "engine.py")
  assert "maxtext.inference.kv_cache_manager" in imported_modules(SUPPORT / "kv_cache_checks.py")
  assert _is_support("support.kv_cache_checks") and not _is_support("maxtext.inference.kv_cache_manager")


def test_the_package_holds_no_testing_folder():
  # The helpers' former home inside the package, which put them in the wheel.
  assert not (SRC / "maxtext" / "testing").exists()
