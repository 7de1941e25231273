"""docs/tpu-inference-kv-cache-spec.patch still applies to the released tpu-inference wheel's KV cache manager.

The wheel is fetched once into the cache dir (tests/conftest.py); `patch --dry-run` checks the hunks against the
unpacked `tpu_inference/runner/kv_cache_manager.py` (`.ci/run` installs `patch` where it is missing).
"""

import ast
import pathlib
import shutil
import subprocess

import pytest

from maxtext.testing import tpu_inference_wheel

_PATCH = pathlib.Path(__file__).resolve().parents[3] / "docs" / "tpu-inference-kv-cache-spec.patch"


def _copy_target(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  target = dest / tpu_inference_wheel.KV_CACHE_MANAGER
  target.parent.mkdir(parents=True)
  shutil.copy(source / tpu_inference_wheel.KV_CACHE_MANAGER, target)
  return target


def _patch(directory: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
  if shutil.which("patch") is None:
    pytest.fail("the patch binary is missing: apt-get install -y patch (.ci/run does this)")
  with _PATCH.open("rb") as diff:
    return subprocess.run(
        ["patch", "--batch", "--fuzz=0", "-p1", "-d", str(directory), *flags],
        stdin=diff,
        capture_output=True,
        check=False,
    )


def test_the_patch_applies_cleanly_to_the_released_kv_cache_manager(tpu_inference_source, tmp_path):
  _copy_target(tpu_inference_source, tmp_path)
  done = _patch(tmp_path, "--dry-run")
  assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
  out = done.stdout.decode()
  assert "checking file tpu_inference/runner/kv_cache_manager.py" in out
  assert "FAILED" not in out and "offset" not in out and "fuzz" not in out, out


def test_the_patched_manager_is_valid_python_that_asks_the_model(tpu_inference_source, tmp_path):
  target = _copy_target(tpu_inference_source, tmp_path)
  done = _patch(tmp_path)
  assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
  tree = ast.parse(target.read_text())
  manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVCacheManager")
  methods = {n.name for n in manager.body if isinstance(n, ast.FunctionDef)}
  assert {"_add_jax_model_kv_cache_specs", "_pad_hybrid_page_sizes", "get_kv_cache_spec"} <= methods
  assert '"get_kv_cache_spec_data"' in target.read_text()


def test_a_patch_that_does_not_match_is_reported(tpu_inference_source, tmp_path):
  # The check can fail: against a manager missing the patched lines, patch refuses.
  target = _copy_target(tpu_inference_source, tmp_path)
  target.write_text(target.read_text().replace("kv_share_map = compute_kv_share_map(text_config)", "kv_share_map = {}"))
  assert _patch(tmp_path, "--dry-run").returncode != 0
