"""Fixtures of the upstream tier: reference tokens from the main venv (tiny folders, and a GGUF checkpoint made a
folder by transformers), a patched copy of tpu-inference, and one vLLM engine per run in a process of its own
(`driver.py`).

The tier runs in the vLLM venv that `scripts/upstream_tier.sh` builds; `MAXTEXT_MAIN_PYTHON` names the main venv's
interpreter (default: the repository's `.venv`), which builds the Hugging Face folders and the reference tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import cases  # pylint: disable=wrong-import-position
import serve  # pylint: disable=wrong-import-position
import stand_ins  # pylint: disable=wrong-import-position

SPEC_PATCH = REPO / "docs" / "tpu-inference-kv-cache-spec.patch"
# This process imports tpu_inference too (its metadata classes, its mesh axis names): no metadata-server polling.
os.environ.update(stand_ins.environment())
RUN_TIMEOUT_S = 600


def pytest_terminal_summary(terminalreporter):
  """serve_test.py's request timings and allocator_test.py's figures, when they ran."""
  allocator = sys.modules.get("allocator_test")
  sections = (("vllm serve timings", serve.summary()),)
  if allocator is not None:
    sections += (("the hybrid allocator through vLLM's scheduler, 4k context", allocator.summary()),)
  for title, lines in sections:
    if lines:
      terminalreporter.section(title)
      for line in lines:
        terminalreporter.write_line(line)


def _main_python() -> str:
  return os.environ.get("MAXTEXT_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> dict[str, dict]:
  """`{case: {"folder", "transformers", "maxtext"}}`, computed once per session in the main venv."""
  out = tmp_path_factory.mktemp("references")
  spec = out / "cases.json"
  spec.write_text(json.dumps(cases.reference_cases()), encoding="utf-8")
  subprocess.run(
      [_main_python(), str(HERE / "references.py"), str(out), str(spec)],
      check=True,
      timeout=RUN_TIMEOUT_S,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  return {name: json.loads((out / f"{name}.json").read_text(encoding="utf-8")) for name in cases.reference_cases()}


@pytest.fixture(scope="session")
def gguf_reference(tmp_path_factory):
  """`reference(gguf, prompts, max_tokens) -> {"folder", "sha256", "prompt_ids", "transformers"}`: the GGUF file as
  a Hugging Face folder made by transformers (cached beside the file) and transformers' greedy tokens on the
  prompts (texts), computed in the main venv (`gguf_reference.py`)."""

  def reference(gguf: str, prompts: list[str], max_tokens: int) -> dict:
    out = tmp_path_factory.mktemp("gguf_reference")
    spec = {"gguf": gguf, "cache_dir": os.path.dirname(os.path.abspath(gguf)), "prompts": prompts}
    (out / "spec.json").write_text(json.dumps({**spec, "max_tokens": max_tokens}), encoding="utf-8")
    subprocess.run(
        [_main_python(), str(HERE / "gguf_reference.py"), str(out / "spec.json"), str(out / "reference.json")],
        check=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads((out / "reference.json").read_text(encoding="utf-8"))

  return reference


@pytest.fixture(name="patched_tpu_inference", scope="session")
def fixture_patched_tpu_inference(tmp_path_factory) -> pathlib.Path:
  """A folder holding a copy of the installed tpu_inference package with the repository's spec patch applied, as
  a user applies it (`patch -p1` in the folder above the package); put first on PYTHONPATH it replaces the
  installed one for a run."""
  installed = importlib.util.find_spec("tpu_inference").submodule_search_locations[0]  # found, not imported
  root = tmp_path_factory.mktemp("patched")
  shutil.copytree(installed, root / "tpu_inference", ignore=shutil.ignore_patterns("__pycache__"))
  with SPEC_PATCH.open("rb") as patch:
    subprocess.run(["patch", "-p1", "--forward", "--quiet", "-d", str(root)], stdin=patch, check=True)
  return root


@pytest.fixture(name="scratch_home", scope="session")
def fixture_scratch_home(tmp_path_factory) -> pathlib.Path:
  """HOME of every run: vLLM's and this package's caches stay out of the user's home."""
  return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="session")
def run_vllm(tmp_path_factory, patched_tpu_inference, scratch_home):
  """`run(model, patched=..., engine=, maxtext_config=, prompts=, rounds=, max_tokens=, devices=1,
  watch_scheduler=False) -> result`:
  one vLLM engine over this package's model in a fresh process (see driver.py for the result). A run with the
  same arguments is made once per session: several tests read one run."""
  done: dict[str, dict] = {}

  def run(
      model: str,
      *,
      patched: bool,
      engine: dict | None = None,
      maxtext_config: dict | None = None,
      prompts=cases.PROMPTS,
      rounds=(),
      max_tokens: int = cases.MAX_TOKENS,
      devices: int = 1,
      watch_scheduler: bool = False,
  ) -> dict:
    spec = {
        "model": model,
        "maxtext_config": {**cases.MAXTEXT_CONFIG, **(maxtext_config or {})},
        "prompts": [list(p) for p in prompts],
        "rounds": [[list(p) for p in prompts_of_round] for prompts_of_round in rounds],
        "max_tokens": max_tokens,
        "engine": {**cases.ENGINE, **(engine or {})},
        "watch_scheduler": watch_scheduler,
        "trace_resume": watch_scheduler,
    }
    key = json.dumps([spec, patched, devices], sort_keys=True)
    if key in done:
      return done[key]
    run_dir = tmp_path_factory.mktemp("run")
    spec_path, out_path, log_path = run_dir / "spec.json", run_dir / "out.json", run_dir / "run.log"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, **stand_ins.environment(), "HOME": str(scratch_home)}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    if patched:
      env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(patched_tpu_inference), env.get("PYTHONPATH")]))
    with log_path.open("w") as log:
      proc = subprocess.run(
          [sys.executable, str(HERE / "driver.py"), str(spec_path), str(out_path)],
          stdout=log,
          stderr=subprocess.STDOUT,
          env=env,
          timeout=RUN_TIMEOUT_S,
          check=False,
      )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
      noise = ("Error getting device name", "vllm._C", "skip_tokenizer_init")
      errors = [
          line
          for line in text.splitlines()
          if "Error" in line and not line.startswith("[rank0]:   ") and not any(n in line for n in noise)
      ]
      raise AssertionError(f"vLLM run failed ({proc.returncode}):\n" + "\n".join(errors[-15:]))
    result = json.loads(out_path.read_text(encoding="utf-8"))
    result["log"] = text
    done[key] = result
    return result

  return run
