"""Tests of the prepared-weights cache: round trips of every dtype, keys, the digest memo, corruption and the size
limit; and the engine's use of it (a second engine over the same checkpoint reads the entry and decodes alike)."""

import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import save_params, weight_cache
from maxtext.configs import load_config
from maxtext.inference import SamplingParams
from maxtext.inference.engine import LLMEngine
from maxtext.models import Transformer

MODEL_KEYS = {"model_name": "llama-tiny", "weight_dtype": "float32", "max_target_length": 64, "base_emb_dim": 64}
BACKEND = {"name": "cpu", "class": "CpuBackend", "weight_panels": True}


def _leaves():
  rng = np.random.default_rng(0)
  return [
      rng.standard_normal((3, 5)).astype(np.float32),
      np.asarray(jnp.asarray(rng.standard_normal((7,)), jnp.bfloat16)),
      rng.integers(0, 256, (4, 33), dtype=np.uint8),  # a packed int8 layout: odd sizes, unaligned ends
      rng.integers(-128, 128, (9,), dtype=np.int8),
      np.zeros((0, 4), np.float32),
      rng.standard_normal((2, 2)).astype(np.float16),
  ]


def _key(leaves, **changes):
  args = {"model_keys": MODEL_KEYS, "source": ("gguf_model_path", "ab" * 32), "backend": BACKEND, "structure": "t"}
  args.update(changes)
  return weight_cache.cache_key(leaves=leaves, **args)


def test_store_then_load_gives_the_same_arrays_read_only_and_aligned(tmp_path):
  cache, leaves = weight_cache.WeightCache(tmp_path), _leaves()
  key = _key(leaves)
  assert cache.load(key) is None  # nothing stored yet
  assert cache.store(key, leaves, {"prepared_bytes": 60})
  entry = cache.load(key)
  assert entry.extra == {"prepared_bytes": 60}
  for got, want in zip(entry.leaves, leaves, strict=True):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit, bfloat16 included
    assert not got.flags.writeable
    assert got.size == 0 or got.ctypes.data % weight_cache.ALIGN == 0
  assert [p.name for p in cache.entries()] == [cache.path_for(key).name]


def test_load_hands_jax_the_mapped_memory_without_a_copy(tmp_path):
  cache, leaves = weight_cache.WeightCache(tmp_path), _leaves()[:1]
  key = _key(leaves)
  cache.store(key, leaves)
  (leaf,) = cache.load(key).leaves
  assert jax.device_put(leaf).unsafe_buffer_pointer() == leaf.ctypes.data


@pytest.mark.parametrize(
    "change",
    [
        {"model_keys": dict(MODEL_KEYS, weight_dtype="bfloat16")},
        {"model_keys": dict(MODEL_KEYS, base_emb_dim=128)},
        {"source": ("gguf_model_path", "cd" * 32)},
        {"source": ("hf_model_path", "ab" * 32)},
        {"backend": dict(BACKEND, weight_panels=False)},
        {"backend": dict(BACKEND, name="reference")},
        {"structure": "another tree"},
    ],
)
def test_the_key_changes_with_what_changes_the_arrays(tmp_path, change):
  leaves = _leaves()
  cache = weight_cache.WeightCache(tmp_path)
  assert cache.path_for(_key(leaves, **change)) != cache.path_for(_key(leaves))


def test_the_key_changes_with_the_leaves_and_the_code_but_not_with_runtime_keys(monkeypatch):
  leaves = _leaves()
  assert _key(leaves) != _key(leaves[:-1])
  assert _key(leaves) != _key([leaves[0].astype(np.float64)] + leaves[1:])
  runtime = dict(MODEL_KEYS, max_target_length=4096, num_kv_blocks=9, gguf_model_path="/elsewhere.gguf")
  assert _key(leaves, model_keys=runtime) == _key(leaves)
  code = _key(leaves)["code"]
  assert code == weight_cache.code_digest() and len(code) == 64
  monkeypatch.setattr(weight_cache, "code_digest", lambda: "0" * 64)  # another version of the converting code
  assert _key(leaves)["code"] == "0" * 64 != code


def test_a_model_key_that_is_not_json_data_is_refused():
  with pytest.raises(TypeError, match="model keys must be JSON data"):
    _key(_leaves(), model_keys={"x": object()})


def test_file_digest_is_the_content_sha256_and_is_remembered_while_the_file_is_unchanged(tmp_path, monkeypatch):
  path, memo = tmp_path / "model.gguf", tmp_path / "hashes"
  path.write_bytes(b"weights v1" * 1000)
  expected = hashlib.sha256(path.read_bytes()).hexdigest()
  assert weight_cache.file_digest(path, memo) == expected
  copy = tmp_path / "copy.gguf"
  copy.write_bytes(path.read_bytes())
  assert weight_cache.file_digest(copy, memo) == expected  # same content, another file: the same digest

  def no_read(*args, **kwargs):
    raise AssertionError("the file was read again")

  with monkeypatch.context() as patched:
    patched.setattr(weight_cache.hashlib, "file_digest", no_read)
    assert weight_cache.file_digest(path, memo) == expected  # unchanged: from the memo
  stat = os.stat(path)
  path.write_bytes(b"weights v2" * 1000)  # same size, and the old mtime put back: the ctime still moves
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert weight_cache.file_digest(path, memo) == hashlib.sha256(path.read_bytes()).hexdigest() != expected


def test_source_digest_of_a_folder_covers_every_file_and_its_name(tmp_path):
  folder = tmp_path / "hf"
  (folder / "sub").mkdir(parents=True)
  (folder / "config.json").write_text("{}")
  (folder / "sub" / "model.safetensors").write_bytes(b"\x01\x02")
  before = weight_cache.source_digest(folder)
  assert weight_cache.source_digest(folder) == before
  (folder / "sub" / "model.safetensors").rename(folder / "sub" / "other.safetensors")
  renamed = weight_cache.source_digest(folder)
  (folder / "sub" / "other.safetensors").write_bytes(b"\x01\x03")
  assert len({before, renamed, weight_cache.source_digest(folder)}) == 3
  with pytest.raises(FileNotFoundError):
    weight_cache.source_digest(tmp_path / "missing.gguf")


def _corrupt_truncated(path):
  os.truncate(path, os.path.getsize(path) - 1)


def _corrupt_magic(path):
  data = bytearray(path.read_bytes())
  data[0] ^= 0xFF
  path.write_bytes(bytes(data))


def _corrupt_header(path):
  data = bytearray(path.read_bytes())
  start = len(weight_cache.MAGIC) + 8
  data[start : start + 5] = b"{{{{{"
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_magic, _corrupt_header])
def test_a_corrupt_entry_is_a_logged_miss_and_is_removed(tmp_path, caplog, corrupt):
  cache, leaves = weight_cache.WeightCache(tmp_path), _leaves()
  key = _key(leaves)
  cache.store(key, leaves)
  corrupt(cache.path_for(key))
  with caplog.at_level(logging.WARNING, logger=weight_cache.__name__):
    assert cache.load(key) is None
  assert "is unusable" in caplog.text and not cache.path_for(key).exists()
  assert cache.store(key, leaves) and cache.load(key) is not None  # rebuilt


def test_an_entry_under_another_keys_name_is_not_taken(tmp_path):
  cache, leaves = weight_cache.WeightCache(tmp_path), _leaves()
  key, other = _key(leaves), _key(leaves, structure="other")
  cache.store(key, leaves)
  cache.path_for(key).rename(cache.path_for(other))
  assert cache.load(other) is None and cache.load(key) is None


def test_store_refuses_leaves_that_are_not_the_keys(tmp_path):
  leaves = _leaves()
  with pytest.raises(ValueError, match="not those of the key"):
    weight_cache.WeightCache(tmp_path).store(_key(leaves), leaves[:-1])


def test_the_size_limit_removes_least_recently_used_entries_and_skips_oversized_ones(tmp_path):
  leaves = [np.ones((1000,), np.float32)]
  keys = [_key(leaves, structure=str(i)) for i in range(3)]
  probe = weight_cache.WeightCache(tmp_path / "probe")
  probe.store(keys[0], leaves)
  size = probe.path_for(keys[0]).stat().st_size
  cache = weight_cache.WeightCache(tmp_path, max_bytes=2 * size + size // 2)  # room for two entries
  for key in keys[:2]:
    assert cache.store(key, leaves)
  os.utime(cache.path_for(keys[1]), (1, 1))
  assert cache.load(keys[0]) is not None  # used now: the other one is the least recently used
  assert cache.store(keys[2], leaves)
  assert cache.path_for(keys[0]).exists() and cache.path_for(keys[2]).exists()
  assert not cache.path_for(keys[1]).exists()
  small = weight_cache.WeightCache(tmp_path / "small", max_bytes=100)
  assert not small.store(keys[0], leaves) and small.entries() == []


def test_stale_temporary_files_are_removed(tmp_path):
  cache = weight_cache.WeightCache(tmp_path)
  stale, fresh = tmp_path / ".tmp-old.weights", tmp_path / ".tmp-new.weights"
  stale.write_bytes(b"x")
  fresh.write_bytes(b"x")
  os.utime(stale, (1, 1))
  cache.prune()
  assert not stale.exists() and fresh.exists()


def test_a_store_that_cannot_write_is_logged_not_raised(tmp_path, caplog):
  (tmp_path / "file").write_text("")
  cache, leaves = weight_cache.WeightCache(tmp_path / "file" / "cache"), _leaves()
  with caplog.at_level(logging.WARNING, logger=weight_cache.__name__):
    assert not cache.store(_key(leaves), leaves)
  assert "could not write the weight cache entry" in caplog.text


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_bytes_must_be_a_positive_integer(tmp_path, bad):
  with pytest.raises(ValueError, match="weight_cache_max_bytes must be a positive integer"):
    weight_cache.WeightCache(tmp_path, bad)


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.delenv("MAXTEXT_WEIGHT_CACHE_DIR", raising=False)
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path / "root"))
  assert weight_cache.default_folder() == tmp_path / "root" / "weights"
  monkeypatch.setenv("MAXTEXT_WEIGHT_CACHE_DIR", str(tmp_path / "own"))
  assert weight_cache.default_folder() == tmp_path / "own"


def test_backend_fingerprint_keeps_the_name_and_plain_options():
  class Backend:
    """A backend's attributes: a name, an option, an object and a private field."""

    name = "cpu"

    def __init__(self):
      self.weight_panels, self.mesh, self._private = True, object(), 1

  assert weight_cache.backend_fingerprint(Backend()) == {
      "name": "cpu",
      "class": Backend.__qualname__,
      "weight_panels": True,
  }


# ---------------------------------------------------------------------------------------------- the engine's use

RUNNER = {"max_num_batched_tokens": 16, "min_token_bucket": 16, "max_target_length": 32, "background_compile": False}


def _engine(checkpoint, **overrides):
  return LLMEngine(load_config(model_name="llama-tiny", load_parameters_path=checkpoint, **dict(RUNNER, **overrides)))


def _tokens(engine):
  rid = engine.add_request([1, 5, 9, 3], SamplingParams(max_tokens=4, temperature=0.0))
  while engine.has_unfinished_requests():
    for finished in engine.step():
      if finished.request_id == rid:
        return finished.output_token_ids
  raise AssertionError("the request did not finish")


@pytest.fixture(name="checkpoint")
def fixture_checkpoint(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTEXT_WEIGHT_CACHE_DIR", str(tmp_path / "weights"))
  return save_params(tmp_path / "ckpt", Transformer(load_config(model_name="llama-tiny"), rngs=nnx.Rngs(3)))


def test_a_second_engine_reads_the_prepared_weights_and_decodes_alike(checkpoint, tmp_path):
  first = _engine(checkpoint)
  assert not first.weights_from_cache
  (entry,) = weight_cache.WeightCache(tmp_path / "weights").entries()
  second = _engine(checkpoint, max_target_length=48)  # a runtime key: the same entry
  assert second.weights_from_cache and second.prepared_bytes == first.prepared_bytes
  for a, b in zip(first.weights.leaves, second.weights.leaves, strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _tokens(second) == _tokens(first)
  assert weight_cache.WeightCache(tmp_path / "weights").entries() == [entry]
  # The model holds the cached weights too (what parameter checks read).
  assert isinstance(nnx.state(second.model.model), nnx.State)


def test_another_weight_dtype_or_backend_layout_is_another_entry(checkpoint, tmp_path):
  _engine(checkpoint)
  other = _engine(checkpoint, cpu_weight_panels=False, kernel_backend="cpu")
  assert not other.weights_from_cache
  assert len(weight_cache.WeightCache(tmp_path / "weights").entries()) == 2


def test_weight_cache_false_reads_and_writes_nothing(checkpoint, tmp_path):
  _engine(checkpoint, weight_cache=False)
  assert not (tmp_path / "weights").exists() or weight_cache.WeightCache(tmp_path / "weights").entries() == []


def test_a_corrupt_entry_is_rebuilt_by_the_engine(checkpoint, tmp_path):
  tokens = _tokens(_engine(checkpoint))
  (entry,) = weight_cache.WeightCache(tmp_path / "weights").entries()
  _corrupt_truncated(entry)
  rebuilt = _engine(checkpoint)
  assert not rebuilt.weights_from_cache and _tokens(rebuilt) == tokens
  assert _engine(checkpoint).weights_from_cache


def test_run_entry_is_none_without_a_checkpoint_or_with_the_cache_off():
  cfg = load_config(model_name="llama-tiny")
  assert weight_cache.run_entry(cfg, object(), "t", []) is None
  off = ml_collections.FrozenConfigDict(dict(cfg.as_configdict().to_dict(), weight_cache=False))
  assert weight_cache.run_entry(off, object(), "t", []) is None


def test_a_missing_checkpoint_has_no_entry_and_the_loader_names_it(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTEXT_WEIGHT_CACHE_DIR", str(tmp_path / "weights"))
  cfg = load_config(model_name="llama-tiny", load_parameters_path=str(tmp_path / "missing"))
  assert weight_cache.run_entry(cfg, object(), "t", []) is None
  with pytest.raises(Exception, match="missing' does not exist"):
    LLMEngine(load_config(model_name="llama-tiny", load_parameters_path=str(tmp_path / "missing"), **RUNNER))


def test_an_unchanged_entry_file_is_what_json_says(checkpoint, tmp_path):
  _engine(checkpoint)
  (entry,) = weight_cache.WeightCache(tmp_path / "weights").entries()
  data = entry.read_bytes()
  assert data.startswith(weight_cache.MAGIC)
  length = int.from_bytes(data[len(weight_cache.MAGIC) : len(weight_cache.MAGIC) + 8], "little")
  header = json.loads(data[len(weight_cache.MAGIC) + 8 : len(weight_cache.MAGIC) + 8 + length])
  assert header["key"]["source"][0] == "load_parameters_path"
  assert (
      header["key"]["model_keys"]["model_name"] == "llama-tiny" and "max_target_length" not in header["key"]["model_keys"]
  )
  assert len(data) == header["data_start"] + header["data_bytes"]


def test_cached_weights_are_copied_out_of_the_file_placed_and_adopted_between_steps(checkpoint):
  tokens = _tokens(_engine(checkpoint, kernel_backend="cpu"))
  engine = _engine(checkpoint, kernel_backend="cpu", huge_page_weights=True)
  assert engine.weights_from_cache
  cached = list(engine.weights.leaves)
  rid = engine.add_request([1, 5, 9, 3], SamplingParams(max_tokens=4, temperature=0.0))
  engine.step()  # the first step starts the placing thread, which copies the file's views
  # It calls into XLA: not a daemon, or a process exiting meanwhile would abort inside C++.
  assert not engine.weights.placing.daemon
  engine.weights.placing.join()
  # The copies' placing is system calls only: a daemon the exit does not wait for.
  assert engine.weights.placing_copies.daemon
  engine.weights.placing_copies.join()
  assert engine.placed_bytes is not None  # the thread ran (a tiny model may hold no whole 2 MiB page to move)
  assert engine.weights.leaves == cached  # adopted at the next step only
  out = {}
  while engine.has_unfinished_requests():
    for finished in engine.step():
      out[finished.request_id] = finished.output_token_ids
  adopted = engine.weights.leaves
  assert all(a is not b for a, b in zip(adopted, cached, strict=True))
  for a, b in zip(adopted, cached, strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert out[rid] == tokens
  assert jax.tree_util.tree_leaves(nnx.state(engine.model.model))[0] is adopted[0]
