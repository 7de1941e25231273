"""The wheel `pip wheel .` builds holds the product and nothing else: every module and data file of `src/maxtext/`,
and no test code (no `testing/` or `support/` package, no `*_test.py`, no fakes, nothing importing a test library).
"""

import ast
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "maxtext"
DATA_SUFFIXES = (".yml", ".cc", ".h")
TEST_LIBRARIES = ("unittest", "pytest", "hypothesis")


def _can_build_without_isolation() -> bool:
  """Whether this environment's setuptools can build the project itself (pyproject's `setuptools>=77`), so the
  build needs no download; otherwise pip builds in an isolated environment fetched from the index."""
  try:
    major = int(importlib.metadata.version("setuptools").split(".")[0])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return False
  return major >= 77


@pytest.fixture(scope="module", name="wheel_files")
def fixture_wheel_files(tmp_path_factory) -> dict[str, bytes]:
  """`{path in the wheel: content}` of the wheel built from a copy of the project (the build writes `build/` and
  an `.egg-info` folder beside its sources, which must not land in the working tree other tests read)."""
  tree = tmp_path_factory.mktemp("project")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, tree / name)
  shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
  out = tmp_path_factory.mktemp("wheel")
  command = [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--quiet", "-w", str(out)]
  if _can_build_without_isolation():
    command.append("--no-build-isolation")
  result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
  assert result.returncode == 0, result.stderr
  (wheel,) = out.glob("maxtext-*.whl")
  with zipfile.ZipFile(wheel) as archive:
    return {name: archive.read(name) for name in archive.namelist() if not name.endswith("/")}


def _package_files(wheel_files: dict[str, bytes]) -> set[str]:
  """The wheel's files under `maxtext/`, relative to it (the rest is the `.dist-info` metadata)."""
  return {name.removeprefix("maxtext/") for name in wheel_files if name.startswith("maxtext/")}


def _is_test_module(name: str) -> bool:
  parts = pathlib.PurePosixPath(name).parts
  stem = pathlib.PurePosixPath(name).stem
  return (
      bool({"testing", "support", "tests"} & set(parts[:-1]))
      or stem.endswith("_test")
      or stem.startswith(("test_", "fake_"))
      or stem == "conftest"
  )


def _imported_roots(source: bytes) -> set[str]:
  roots = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      roots.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      roots.add(node.module.split(".")[0])
  return roots


def test_the_wheel_holds_no_test_module(wheel_files):
  names = sorted(wheel_files)
  assert all(name.startswith(("maxtext/", "maxtext-")) for name in names), names  # only the package and its metadata
  assert not [name for name in names if name.endswith(".py") and _is_test_module(name)]
  importing = {
      name: sorted(set(TEST_LIBRARIES) & _imported_roots(content))
      for name, content in wheel_files.items()
      if name.endswith(".py")
  }
  assert not {name: libs for name, libs in importing.items() if libs}


def test_the_wheel_holds_every_module_and_data_file_of_the_package(wheel_files):
  packaged = _package_files(wheel_files)
  sources = {
      path.relative_to(PACKAGE).as_posix()
      for path in PACKAGE.rglob("*")
      if path.is_file() and (path.suffix == ".py" or path.suffix in DATA_SUFFIXES) and "__pycache__" not in path.parts
  }
  assert {"configs/base.yml", "kernels/cpu/small_gemm.cc", "kernels/cpu/simd.h", "decode.py"} <= sources
  assert any(name.startswith("configs/models/") and name.endswith(".yml") for name in sources)
  assert sources - packaged == set()
  assert {name for name in packaged if name.endswith(DATA_SUFFIXES + (".py",))} == sources


def test_is_test_module_names_tests_support_and_fakes():
  assert _is_test_module("maxtext/testing/reference.py") and _is_test_module("maxtext/support/hlo.py")
  assert _is_test_module("maxtext/layers/attention_test.py") and _is_test_module("maxtext/fake_vllm_config.py")
  assert not _is_test_module("maxtext/inference/engine.py") and not _is_test_module("maxtext/kernels/cpu/backend.py")


def test_imported_roots_reads_absolute_imports_only():
  source = b"import os.path\nfrom unittest import mock\nfrom . import sibling\nimport pytest as pt\n"
  assert _imported_roots(source) == {"os", "unittest", "pytest"}
