"""Convert a local Hugging Face folder or GGUF file to an Orbax parameter checkpoint plus a YAML of its config keys.

    python scripts/convert_hf_checkpoint.py --hf_model_path DIR --output_dir OUT [--weight_dtype bfloat16]
    python scripts/convert_hf_checkpoint.py --gguf_model_path FILE --output_dir OUT

writes
    OUT/params/             Orbax checkpoint of the canonical parameters (in weight_dtype)
    OUT/maxtext_model.yml   the model keys derived from config.json (or the GGUF metadata), weight_dtype,
                            load_parameters_path=OUT/params and tokenizer_path=DIR (or gguf_model_path=FILE, which
                            then supplies the tokenizer and chat template; the weights come from the Orbax copy)
The YAML sets `base_config: base.yml`, so it is a config of its own: `maxtext-decode OUT/maxtext_model.yml
prompt=...` decodes the converted copy, and `load_converted_config(OUT, **overrides)` loads it in Python, after
which `maxtext.checkpoint.load_model(cfg)` restores the parameters from `load_parameters_path`.
"""

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, NoReturn

import ml_collections
import yaml

from maxtext.checkpoint import orbax, source
from maxtext.configs import load_config

logger = logging.getLogger(__name__)

PARAMS_DIR = "params"
MODEL_CONFIG_FILE = "maxtext_model.yml"
EXIT_USAGE = 2


class _ArgumentParser(argparse.ArgumentParser):
  """argparse with one-line errors on stderr (exit status 2)."""

  def error(self, message: str) -> NoReturn:
    self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def convert(
    hf_model_path: str | os.PathLike | None,
    output_dir: str | os.PathLike,
    *,
    weight_dtype: str = "float32",
    progress: bool = True,
    gguf_model_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
  """Converts a Hugging Face folder or a GGUF file; see the module docstring for the files written.

  Args:
    hf_model_path: local folder with config.json and safetensors (None with `gguf_model_path`).
    output_dir: folder to create (it must not already hold a converted checkpoint). Everything is written into
      a temporary sibling folder first and renamed into place at the end, so a failure leaves nothing behind.
    weight_dtype: parameter dtype of the checkpoint (float32 | bfloat16).
    progress: show a tqdm progress bar on stderr while reading the safetensors.
    gguf_model_path: a GGUF file to convert instead of a Hugging Face folder.

  Returns:
    The keys written to maxtext_model.yml.

  Raises:
    FileExistsError: output_dir already holds a checkpoint.
    ValueError: both or neither of hf_model_path and gguf_model_path given.
    FileNotFoundError, ValueError, NotImplementedError: as the source's `load_config` / `iter_params`
      (`maxtext.checkpoint.source`).
  """
  paths = {source.HF_KEY: hf_model_path, source.GGUF_KEY: gguf_model_path}
  absolute = {key: None if p is None else os.path.abspath(os.path.expanduser(os.fspath(p))) for key, p in paths.items()}
  checkpoint = source.exactly_one_model_source(absolute, "convert")
  out, params_dir = _output_paths(output_dir)
  keys = checkpoint.model_keys()
  keys["weight_dtype"] = weight_dtype
  cfg = checkpoint.load_config(weight_dtype=weight_dtype)
  params = dict(checkpoint.iter_params(cfg, progress=progress))
  keys["load_parameters_path"] = params_dir
  keys.update(checkpoint.tokenizer_keys())
  return _write(checkpoint.path, out, keys, params)


def _write(origin: str, out: str, keys: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
  """Writes params/ and maxtext_model.yml into a staging sibling of `out`, then publishes them by renames."""
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.converting-", dir=parent)
  try:
    orbax.save_params(os.path.join(staging, PARAMS_DIR), params)
    params.clear()
    with open(os.path.join(staging, MODEL_CONFIG_FILE), "w", encoding="utf-8") as f:
      f.write(
          f"# Converted from {origin} by maxtext.checkpoint.convert: the model keys over the package's base.yml.\n"
          f"# Decode with: maxtext-decode {os.path.join(out, MODEL_CONFIG_FILE)} prompt=...\n"
      )
      yaml.safe_dump({"base_config": "base.yml", **keys}, f, sort_keys=False)
    _publish(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  logger.info("converted %s -> %s", origin, out)
  return keys


def _publish(staging: str, out: str) -> None:
  """Moves a finished conversion from `staging` to `out` by renames, so `out` never holds half a checkpoint.

  A missing `out` is one rename of the whole folder. An existing folder (without a checkpoint) gets params/
  first and maxtext_model.yml last, the file that marks the folder as converted; a failure in between takes
  params/ back out.
  """
  if not os.path.exists(out):
    os.rename(staging, out)
    return
  params_dir = os.path.join(out, PARAMS_DIR)
  os.rename(os.path.join(staging, PARAMS_DIR), params_dir)
  try:
    os.rename(os.path.join(staging, MODEL_CONFIG_FILE), os.path.join(out, MODEL_CONFIG_FILE))
  except BaseException:
    shutil.rmtree(params_dir, ignore_errors=True)
    raise
  os.rmdir(staging)


def _output_paths(output_dir: str | os.PathLike) -> tuple[str, str]:
  out = os.path.abspath(os.fspath(output_dir))
  params_dir = os.path.join(out, PARAMS_DIR)
  if os.path.exists(params_dir) or os.path.exists(os.path.join(out, MODEL_CONFIG_FILE)):
    raise FileExistsError(f"output_dir {out!r} already holds a converted checkpoint; choose an empty folder")
  if os.path.exists(out) and not os.path.isdir(out):
    raise FileExistsError(f"output_dir {out!r} is a file; choose a folder")
  return out, params_dir


def load_converted_config(output_dir: str | os.PathLike, **overrides: Any) -> ml_collections.FrozenConfigDict:
  """Loads the config of a converted checkpoint folder (its maxtext_model.yml, then `overrides`).

  Raises:
    FileNotFoundError: the folder has no maxtext_model.yml.
  """
  path = os.path.join(os.fspath(output_dir), MODEL_CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{os.fspath(output_dir)!r} has no {MODEL_CONFIG_FILE}; is it a converted checkpoint?")
  return load_config([path], **overrides)


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point; returns the exit status (0, or 2 with one line on stderr for bad input)."""
  parser = _ArgumentParser(
      prog="convert_hf_checkpoint", description="Convert a Hugging Face folder or a GGUF file to an Orbax checkpoint."
  )
  choice = parser.add_mutually_exclusive_group(required=True)
  choice.add_argument("--hf_model_path", help="local folder with config.json and *.safetensors")
  choice.add_argument("--gguf_model_path", help="local GGUF file (llama.cpp format)")
  parser.add_argument("--output_dir", required=True, help="folder to write params/ and maxtext_model.yml into")
  parser.add_argument("--weight_dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
  parser.add_argument("--no_progress", action="store_true", help="do not show a progress bar")
  args = parser.parse_args(argv)
  try:
    keys = convert(
        args.hf_model_path,
        args.output_dir,
        weight_dtype=args.weight_dtype,
        progress=not args.no_progress,
        gguf_model_path=args.gguf_model_path,
    )
  except (OSError, ValueError, NotImplementedError) as e:
    message = " ".join(str(e).split())
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE
  print(f"wrote {keys['load_parameters_path']} and {os.path.join(os.path.abspath(args.output_dir), MODEL_CONFIG_FILE)}")
  return 0
