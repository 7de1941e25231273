"""The prepared parameters of a checkpoint kept on disk, so the next start reads them instead of converting again.

Loading a checkpoint converts every tensor (a GGUF file's quantized blocks are dequantized, a Hugging Face tensor is
transposed and cast) and the kernel backend then lays the result out for its kernels (`prepare_params`: the cpu
backend's column panels). A later start of the same model redoes the same work for the same arrays. The engine
therefore keeps the prepared leaves in one file per (checkpoint content, model, backend layout, code) and, when a
later start asks for the same, reads that file into memory in one pass and hands the buffers to JAX without another
copy (the file is mapped, so the start reads no byte twice and allocates no memory for the weights).

What an entry's key holds (`cache_key`), each a reason the arrays could differ:
  - the checkpoint's content: a SHA-256 of every file of the weights' source (the GGUF file, the Hugging Face or
    Orbax folder). Hashing a 100 MB file costs about 0.1 s, so the digest is kept beside the entries
    (`hashes/`), valid while the file's size, modification and change times (ns), inode and device are the ones it
    was computed for; a copied or moved file is hashed again and finds the same entry, an edited one a new entry.
    The ctime cannot be set back by a program (unlike the mtime), so a file rewritten in place is never taken for
    the old one;
  - the model's config keys, without those that only size the caches, the scheduler or the paths
    (`RUNTIME_KEYS`): the model's shape, family, `weight_dtype`, any quantization key;
  - the kernel backend's name and options (`backend_fingerprint`: e.g. `cpu_weight_panels`), and the prepared
    structure (the tree of leaves with their shapes and dtypes, as the engine computes it from the abstract model);
  - the code that converts: a SHA-256 of this package's checkpoint, model, layer, kernel and config sources, and
    the versions of this package, JAX and NumPy.

An entry is one file: a magic line, a JSON header (the key, each leaf's dtype, shape and offset) and the leaves'
bytes, each at a 64-byte boundary. It is written to a temporary file, flushed to disk and renamed into place, so a
reader never sees half an entry. A file that does not parse, whose header names another key, whose leaves differ
from the ones asked for or whose length is short is reported (`load` returns None with the reason logged), removed,
and the engine converts and stores again. The bytes themselves carry no checksum: like the checkpoint itself they
are trusted once written; whoever can write to the folder chooses the model's weights.

The folder is `$MAXTEXT_WEIGHT_CACHE_DIR`, else `weights/` in this package's cache folder (`$MAXTEXT_CACHE_DIR`,
else `~/.cache/maxtext`). It holds at most `weight_cache_max_bytes` (least recently used entries are removed
first; an entry larger than the limit is not stored); the config key `weight_cache=false` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxtext import user_cache
from maxtext.configs import run_options
from maxtext.configs import keys as config_keys
from maxtext.configs import model_config

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"MAXTEXT-WEIGHTS 1\n"
ALIGN = 64  # bytes: every leaf starts at a multiple (what XLA's CPU buffers need to be used without a copy)
SUFFIX = ".weights"
DEFAULT_MAX_BYTES = 8 << 30
_HEADER_LENGTH = 8  # bytes of the little-endian header length after the magic line
# Config keys that never change a parameter array (category `RUNTIME` in configs/keys.py): the checkpoint paths
# (their content is in the key instead), the caches', scheduler's and tokenizer's settings.
RUNTIME_KEYS = config_keys.RUNTIME_KEYS | model_config.DERIVED_RUNTIME_KEYS
# The package folders whose sources decide what a checkpoint's prepared arrays hold.
_CODE_FOLDERS = ("checkpoint", "configs", "kernels", "layers", "models")


def default_folder() -> Path:
  """`$MAXTEXT_WEIGHT_CACHE_DIR`, else `weights/` in `$MAXTEXT_CACHE_DIR`, else `~/.cache/maxtext/weights`."""
  explicit = os.environ.get("MAXTEXT_WEIGHT_CACHE_DIR")
  if explicit:
    return Path(explicit).expanduser()
  return user_cache.folder("weights")


def _stat_identity(path: str) -> list[int]:
  st = os.stat(path)
  return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_digest(path: str | os.PathLike, memo_folder: str | os.PathLike | None = None) -> str:
  """The SHA-256 of a file's content, hex; with `memo_folder`, kept there and reused while the file's size,
  mtime, ctime, inode and device are unchanged.

  Raises:
    OSError: the file cannot be read.
  """
  path = os.path.realpath(path)
  identity = _stat_identity(path)
  memo = None
  if memo_folder is not None:
    memo = Path(memo_folder) / (hashlib.sha256(path.encode("utf-8")).hexdigest()[:32] + ".json")
    try:
      saved = json.loads(memo.read_text(encoding="utf-8"))
      if saved.get("path") == path and saved.get("identity") == identity and isinstance(saved.get("sha256"), str):
        return saved["sha256"]
    except (OSError, ValueError, AttributeError):
      pass  # no memo yet, or an unreadable one: hash the file
  with open(path, "rb") as f:
    digest = hashlib.file_digest(f, "sha256").hexdigest()
  if memo is not None and _stat_identity(path) == identity:  # not changed while it was read
    with contextlib.suppress(OSError):  # a read-only cache folder: the next start hashes again
      write_atomic(memo, json.dumps({"path": path, "identity": identity, "sha256": digest}).encode("utf-8"))
  return digest


def source_digest(path: str | os.PathLike, memo_folder: str | os.PathLike | None = None) -> str:
  """The SHA-256 of a checkpoint's content: of a file, or of every file under a folder (by relative path).

  Raises:
    OSError: `path` does not exist or a file cannot be read.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    return file_digest(path, memo_folder)
  combined = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      combined.update(f"{os.path.relpath(full, path)}\0{file_digest(full, memo_folder)}\0".encode("utf-8"))
  return combined.hexdigest()


def code_digest() -> str:
  """A SHA-256 of this package's sources that convert and lay out parameters, and of the library versions
  (`user_cache.sources_digest`)."""
  return user_cache.sources_digest(_CODE_FOLDERS)


def backend_fingerprint(backend: Any) -> dict[str, Any]:
  """A kernel backend's name and its plain options (bool, int, float, str attributes: e.g. the cpu backend's
  `weight_panels`), which decide the layouts `prepare_params` writes."""
  options = {k: v for k, v in sorted(vars(backend).items()) if isinstance(v, (bool, int, float, str)) and k[:1] != "_"}
  return {"name": str(getattr(backend, "name", type(backend).__name__)), "class": type(backend).__qualname__, **options}


def leaf_specs(leaves: Sequence[Any]) -> list[list[Any]]:
  """[dtype name, shape] of each leaf (arrays or `jax.ShapeDtypeStruct`s)."""
  return [[np.dtype(leaf.dtype).name, [int(n) for n in leaf.shape]] for leaf in leaves]


def cache_key(
    model_keys: Mapping[str, Any],
    source: tuple[str, str],
    backend: Mapping[str, Any],
    structure: str,
    leaves: Sequence[Any],
) -> dict[str, Any]:
  """The key of an entry: everything that decides the prepared arrays (see the module docstring).

  Args:
    model_keys: the model's config keys (`run_options.model_config`); `RUNTIME_KEYS` are dropped.
    source: (the source's config key, its `source_digest`).
    backend: `backend_fingerprint(backend)`.
    structure: the prepared tree's structure (`str` of its treedef).
    leaves: the prepared leaves' shapes and dtypes (arrays or `jax.ShapeDtypeStruct`s), in tree order.

  Raises:
    TypeError: a model key's value is not JSON data.
  """
  keys = {k: v for k, v in sorted(model_keys.items()) if k not in RUNTIME_KEYS}
  try:
    json.dumps(keys)
  except TypeError as e:
    raise TypeError(f"weight_cache.cache_key: the model keys must be JSON data: {e}") from None
  return {
      "format": FORMAT_VERSION,
      "source": list(source),
      "model_keys": keys,
      "backend": dict(backend),
      "structure": hashlib.sha256(structure.encode("utf-8")).hexdigest(),
      "leaves": leaf_specs(leaves),
      "code": code_digest(),
  }


def write_atomic(path: Path, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file (`.tmp-*`) in the same folder and a rename, so a reader never
  sees a partial file (the step-program cache writes its files through it too)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def _aligned(offset: int) -> int:
  return -(-offset // ALIGN) * ALIGN


@dataclasses.dataclass
class LoadedEntry:
  """A hit: the leaves (read-only NumPy arrays over the entry file's mapping) and what the header recorded."""

  leaves: list[np.ndarray]
  extra: dict[str, Any]


class WeightCache:
  """A folder of prepared-parameter entries (see the module docstring).

  Args:
    folder: where entries live (created on the first store).
    max_bytes: the folder's size limit; least recently used entries are removed beyond it.

  Raises:
    ValueError: `max_bytes` is not a positive integer.
  """

  def __init__(self, folder: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
      raise ValueError(f"weight_cache_max_bytes must be a positive integer, got {max_bytes!r}")
    self.folder = Path(folder).expanduser()
    self.max_bytes = max_bytes

  @property
  def hashes_folder(self) -> Path:
    """Where the checkpoint files' digests are kept (`file_digest`'s memo)."""
    return self.folder / "hashes"

  def path_for(self, key: Mapping[str, Any]) -> Path:
    """The entry file of `key`."""
    return self.folder / (hashlib.sha256(_canonical(key)).hexdigest()[:40] + SUFFIX)

  def load(self, key: Mapping[str, Any]) -> LoadedEntry | None:
    """The entry of `key`, or None when there is none or it is unusable (then it is removed, with the reason
    logged). The leaves are read-only views of the mapped file."""
    path = self.path_for(key)
    try:
      with open(path, "rb") as f:
        return self._read(f, key, path)
    except FileNotFoundError:
      return None
    except (OSError, ValueError, KeyError, TypeError) as e:
      logger.warning("weight cache entry %s is unusable (%s); converting the checkpoint again", path, e)
      with contextlib.suppress(OSError):
        path.unlink()
      return None

  def _read(self, f: Any, key: Mapping[str, Any], path: Path) -> LoadedEntry:
    if f.read(len(MAGIC)) != MAGIC:
      raise ValueError("not an entry of this format")
    length = int.from_bytes(f.read(_HEADER_LENGTH), "little")
    if length > 1 << 26:
      raise ValueError(f"header of {length} bytes")
    header = json.loads(f.read(length).decode("utf-8"))
    if _canonical(header["key"]) != _canonical(key):
      raise ValueError("its header holds another key")
    data_start, total = int(header["data_start"]), int(header["data_bytes"])
    if os.fstat(f.fileno()).st_size != data_start + total:
      raise ValueError(f"{os.fstat(f.fileno()).st_size} bytes, the header says {data_start + total}")
    # The file itself, mapped read-only with its pages populated from the page cache: no fresh memory to fault in
    # and fill (which costs seconds per GB on some virtual machines), and JAX uses the pages without a copy.
    # Entries are replaced by rename and removed by unlink, never rewritten in place, so the mapping stays valid.
    buffer = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    leaves = []
    for (dtype, shape), offset in zip(key["leaves"], header["offsets"], strict=True):
      count = int(np.prod(shape, dtype=np.int64))
      leaves.append(np.frombuffer(buffer, jnp.dtype(dtype), count, data_start + int(offset)).reshape(shape))
    os.utime(path)  # the entry was just used: the least recently used ones go first
    return LoadedEntry(leaves, dict(header.get("extra", {})))

  def store(self, key: Mapping[str, Any], leaves: Sequence[Any], extra: Mapping[str, Any] | None = None) -> bool:
    """Writes the entry of `key` holding `leaves` (arrays in `key`'s order, shapes and dtypes); returns whether
    it was stored. Failures (a full disk, a read-only folder) are logged, never raised: the run goes on without.

    Raises:
      ValueError: the leaves are not those `key` describes.
    """
    if leaf_specs(leaves) != key["leaves"]:
      raise ValueError("weight_cache.store: the leaves' shapes and dtypes are not those of the key")
    offsets, end = [], 0
    for leaf in leaves:
      offsets.append(end)
      end = _aligned(end + int(np.dtype(leaf.dtype).itemsize) * int(np.prod(leaf.shape, dtype=np.int64)))
    total = offsets[-1] + _nbytes(leaves[-1]) if leaves else 0
    if total > self.max_bytes:
      logger.info("weights of %.1f MB exceed weight_cache_max_bytes=%d: not cached", total / 1e6, self.max_bytes)
      return False
    header = {"key": key, "offsets": offsets, "data_bytes": total, "extra": dict(extra or {}), "data_start": 0}
    prefix = b""
    while len(prefix) == 0 or len(prefix) > header["data_start"]:  # the header's length includes data_start
      header["data_start"] = _aligned(len(prefix) + 32)
      body = json.dumps(header).encode("utf-8")
      prefix = MAGIC + len(body).to_bytes(_HEADER_LENGTH, "little") + body
    data_start = header["data_start"]
    path = self.path_for(key)
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      self.prune(reserve=data_start + total)
      fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
      try:
        with os.fdopen(fd, "wb") as f:
          f.write(prefix.ljust(data_start, b"\0"))
          for leaf, offset in zip(leaves, offsets):
            f.seek(data_start + offset)
            f.write(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1).data)
          f.truncate(data_start + total)
          f.flush()
          os.fsync(f.fileno())
        os.replace(tmp, path)
      except BaseException:
        with contextlib.suppress(OSError):
          os.unlink(tmp)
        raise
    except OSError as e:
      logger.warning("could not write the weight cache entry %s: %s", path, e)
      return False
    return True

  def entries(self) -> list[Path]:
    """The entry files, least recently used first."""
    if not self.folder.is_dir():
      return []
    found = []
    for path in self.folder.glob("*" + SUFFIX):
      with contextlib.suppress(OSError):
        found.append((path.stat().st_mtime, path))
    return [path for _, path in sorted(found)]

  def prune(self, reserve: int = 0, stale_temp_s: float = 3600.0) -> list[Path]:
    """Removes least recently used entries until the folder holds at most `max_bytes - reserve` bytes, and
    temporary files older than `stale_temp_s` (left by a process that ended while writing); returns the removed
    entries."""
    now = time.time()
    for tmp in self.folder.glob(".tmp-*") if self.folder.is_dir() else ():
      with contextlib.suppress(OSError):
        if now - tmp.stat().st_mtime > stale_temp_s:
          tmp.unlink()
    entries = self.entries()
    sizes = {}
    for path in entries:
      with contextlib.suppress(OSError):
        sizes[path] = path.stat().st_size
    used, removed = sum(sizes.values()), []
    for path in entries:
      if used + reserve <= self.max_bytes:
        break
      with contextlib.suppress(OSError):
        path.unlink()
        removed.append(path)
        used -= sizes.get(path, 0)
    return removed


def _nbytes(leaf: Any) -> int:
  return int(np.dtype(leaf.dtype).itemsize) * int(np.prod(leaf.shape, dtype=np.int64))


def _canonical(value: Any) -> bytes:
  return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def run_entry(cfg: Any, backend: Any, structure: str, leaves: Sequence[Any]) -> tuple[WeightCache, dict[str, Any]] | None:
  """The cache and the entry key of a run's prepared weights, or None when the run keeps none: `weight_cache` is
  off, or the config names no checkpoint or one that cannot be read.

  Args:
    cfg: the run's config (`weight_cache`, `weight_cache_max_bytes` and the model's keys are read).
    backend: the kernel backend that prepares the parameters.
    structure: the prepared tree's structure (`str` of its treedef).
    leaves: the prepared leaves' shapes and dtypes, in tree order.

  Raises:
    ValueError: `weight_cache_max_bytes` is not a positive integer.
  """
  # pylint: disable=import-outside-toplevel  # source imports the model code; this module is imported before it
  from maxtext.checkpoint import source as checkpoint_source

  if not cfg.weight_cache:
    return None
  weights = checkpoint_source.weights_source(cfg)
  if weights is None:
    return None
  if not all(isinstance(leaf.dtype, np.dtype) and leaf.dtype.itemsize > 0 for leaf in leaves):
    logger.info("the prepared weights hold a leaf that is no plain array (e.g. a random key): not cached")
    return None
  cache = WeightCache(default_folder(), cfg.weight_cache_max_bytes)
  try:
    digest = source_digest(os.path.expanduser(weights.path), cache.hashes_folder)
  except OSError:
    return None  # a missing or unreadable checkpoint: its loader says what is wrong, in its own words
  model_keys = run_options.model_config(cfg).to_dict()
  key = cache_key(model_keys, (weights.key, digest), backend_fingerprint(backend), structure, leaves)
  return cache, key
