"""This package's folder in the user's cache, and the digest of its sources that keys what is kept there.

Files kept from one run for the next (compiled C++ kernels, prepared weights, tokenizer merges; the tests'
tpu-inference wheel) each go to a folder of `$MAXTEXT_CACHE_DIR`, else of `~/.cache/maxtext`. What a kept file
holds was made by this package's code, so its key includes `sources_digest`: a change of that code makes a new key
instead of reading a stale file. The module imports nothing else of the package, so every layer may use it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib
import numpy as np

from maxtext import __version__

PACKAGE = Path(__file__).resolve().parent
SOURCE_SUFFIXES = (".py", ".yml", ".cc", ".h")


def folder(name: str) -> Path:
  """`name/` in this package's cache folder, `$MAXTEXT_CACHE_DIR` else `~/.cache/maxtext` (not created here)."""
  return Path(os.environ.get("MAXTEXT_CACHE_DIR") or Path.home() / ".cache" / "maxtext").expanduser() / name


@functools.cache
def sources_digest(folders: Sequence[str] | None = None) -> str:
  """A SHA-256 of this package's sources (`.py`, `.yml`, `.cc`, `.h`, each by its path in the package and its
  content) and of the versions of maxtext, jax, jaxlib and numpy.

  Args:
    folders: the package's folders whose sources count, in this order (a tuple: the result is cached by it);
      default: the whole package.
  """
  roots = [PACKAGE] if folders is None else [PACKAGE / name for name in folders]
  combined = hashlib.sha256()
  for root in roots:
    for path in sorted(root.rglob("*")):
      if path.suffix in SOURCE_SUFFIXES and path.is_file():
        combined.update(path.relative_to(PACKAGE).as_posix().encode("utf-8") + b"\0" + path.read_bytes() + b"\0")
  versions = f"maxtext {__version__} jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {np.__version__}"
  combined.update(versions.encode("utf-8"))
  return combined.hexdigest()
