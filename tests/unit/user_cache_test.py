"""The package's cache folder and the digest of its sources."""

import pathlib

from maxtext import user_cache
from maxtext.checkpoint import gguf, weight_cache
from maxtext.inference import step_programs
from maxtext.kernels.cpu import cpu_gemm


def test_folder_follows_maxtext_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  assert user_cache.folder("kernels") == tmp_path / "kernels"
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", "~/elsewhere")
  assert user_cache.folder("weights") == pathlib.Path.home() / "elsewhere" / "weights"
  monkeypatch.delenv("MAXTEXT_CACHE_DIR")
  assert user_cache.folder("tokenizers") == pathlib.Path.home() / ".cache" / "maxtext" / "tokenizers"
  assert not (tmp_path / "kernels").exists()  # chosen, not created


def test_every_cache_of_the_package_is_a_folder_of_it(monkeypatch, tmp_path):
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("MAXTEXT_WEIGHT_CACHE_DIR", raising=False)
  assert cpu_gemm.cache_dir() == tmp_path / "kernels"
  assert weight_cache.default_folder() == tmp_path / "weights"
  assert gguf.merges_cache_folder() == tmp_path / "tokenizers"


def _digest_of(monkeypatch, package: pathlib.Path, folders=None) -> str:
  monkeypatch.setattr(user_cache, "PACKAGE", package)
  return user_cache.sources_digest.__wrapped__(folders)  # uncached: the tree changes between calls


def test_sources_digest_reads_the_sources_by_path_and_content(monkeypatch, tmp_path):
  (tmp_path / "layers").mkdir()
  (tmp_path / "models").mkdir()
  (tmp_path / "layers" / "a.py").write_text("x = 1\n")
  (tmp_path / "models" / "b.yml").write_text("k: 1\n")
  whole = _digest_of(monkeypatch, tmp_path)
  layers = _digest_of(monkeypatch, tmp_path, ("layers",))
  assert len(whole) == 64 and whole != layers
  (tmp_path / "models" / "notes.txt").write_text("not a source")
  (tmp_path / "models" / "b.pyc").write_bytes(b"\0")
  assert _digest_of(monkeypatch, tmp_path) == whole
  (tmp_path / "models" / "b.yml").write_text("k: 2\n")
  assert _digest_of(monkeypatch, tmp_path) != whole
  assert _digest_of(monkeypatch, tmp_path, ("layers",)) == layers  # another folder's change
  (tmp_path / "layers" / "a.py").rename(tmp_path / "layers" / "c.py")
  assert _digest_of(monkeypatch, tmp_path, ("layers",)) != layers  # same content, another path


def test_the_two_caches_digest_the_package_through_the_helper():
  assert step_programs.package_digest() == user_cache.sources_digest()
  assert weight_cache.code_digest() == user_cache.sources_digest(("checkpoint", "configs", "kernels", "layers", "models"))
  assert step_programs.package_digest() != weight_cache.code_digest()
