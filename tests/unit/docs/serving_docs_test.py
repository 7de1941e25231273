"""docs/serving.md and docs/runner-contract.md name files, functions, configs and versions that exist."""

import pathlib
import re
import tomllib

import pytest

from support import tpu_inference_wheel
from maxtext.integration.vllm import environment

_ROOT = pathlib.Path(__file__).resolve().parents[3]
_SERVING = (_ROOT / "docs" / "serving.md").read_text()
_CONTRACT = (_ROOT / "docs" / "runner-contract.md").read_text()
# `some/path.py` or `some/path.py::name` inside backticks.
_PY_REF = re.compile(r"`([\w./]+\.(?:py|yml|toml|patch|md))(?:::\s*(\w+))?")


def test_serving_guide_paths_exist_in_the_repository_or_the_wheel(tpu_inference_source):
  refs = {path for path, _ in _PY_REF.findall(_SERVING) if "/" in path or path == "pyproject.toml"}
  assert "tests/unit/kernels/tpu_inference_conformance_test.py" in refs
  roots = (_ROOT, _ROOT / "src" / "maxtext", tpu_inference_source)
  missing = sorted(p for p in refs if not any((root / p).exists() for root in roots))
  assert not missing


def test_runner_contract_paths_and_functions_exist_in_the_wheel_or_here(tpu_inference_source):
  wheel = tpu_inference_source / "tpu_inference"
  refs = _PY_REF.findall(_CONTRACT)
  assert ("layers/common/gdn_attention.py", "run_jax_gdn_attention") in refs
  for path, name in refs:
    if "/" not in path:
      continue
    candidates = [wheel / path, _ROOT / path, _ROOT / "src" / "maxtext" / path]
    found = [c for c in candidates if c.is_file()]
    assert found, f"{path} is neither in the wheel nor in the repository"
    if name:
      assert any(re.search(rf"^\s*def {name}\(", f.read_text(), re.M) for f in found), f"{path}::{name}"


def test_the_documented_entry_point_is_the_one_in_pyproject():
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  ((name, target),) = project["entry-points"]["vllm.general_plugins"].items()
  assert f"{name} = {target}" in _SERVING


@pytest.mark.parametrize("text", [_SERVING, _CONTRACT])
def test_the_documented_version_is_the_one_checked(text):
  version = tpu_inference_wheel.TPU_INFERENCE_VERSION
  assert environment.CHECKED_TPU_INFERENCE_VERSION == version
  assert f"tpu-inference {version}" in text or f"tpu-inference=={version}" in text
  assert not set(re.findall(r"tpu-inference[ =]=?(\d+\.\d+\.\d+)", text)) - {version}


def test_the_bundled_model_names_in_the_serving_guide_exist():
  names = re.findall(r"`((?:qwen|llama|gemma)[\w.-]+)`", _SERVING)
  assert "qwen3.5-35b-a3b" in names
  for name in names:
    assert (_ROOT / "src" / "maxtext" / "configs" / "models" / f"{name}.yml").is_file(), name
