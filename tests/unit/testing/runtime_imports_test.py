"""The runtime never imports `maxtext.testing`: the fakes, checks and wheel fetcher there are for tests only."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[3] / "src"
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
def test_the_runtime_entry_points_import_no_testing_module():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
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
  assert [m for m in report["modules"] if m == "maxtext.testing" or m.startswith("maxtext.testing.")] == []


def _imported_modules(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_no_runtime_module_names_the_testing_package():
  # Static, so an import inside a branch the program above does not reach is caught as well.
  offenders = {}
  for path in sorted((SRC / "maxtext").rglob("*.py")):
    if "testing" in path.relative_to(SRC / "maxtext").parts:
      continue
    bad = sorted(m for m in _imported_modules(path) if m == "maxtext.testing" or m.startswith("maxtext.testing."))
    if bad:
      offenders[str(path.relative_to(SRC))] = bad
  assert not offenders
  # The walk does see the package's imports (a parser that found nothing would pass the check above).
  assert "maxtext.testing.kv_cache_checks" not in _imported_modules(SRC / "maxtext" / "inference" / "engine.py")
  assert "maxtext.inference.kv_cache_manager" in _imported_modules(SRC / "maxtext" / "testing" / "kv_cache_checks.py")
