"""Tiny random Hugging Face checkpoints of every supported family, written by transformers' save_pretrained.

`hf_checkpoint(case, **save_kwargs)` builds the model (float32, seeded), adds seeded noise to every 1-D parameter
and every `*_bias` (norm weights, A_log, dt_bias, biases, sinks, gpt-oss expert biases; transformers initialises
(1+w) norm weights and biases to exactly 0), saves it to a
session-wide temp folder and returns (folder, torch model). Sizes are those of the families' tiny configs. Needs
torch and transformers (tests using it are marked `hf`).
"""

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_cases import CASES, build_hf_model

__all__ = ["CASES", "build_hf_model"]


def _rewrite_checkpoint(folder: pathlib.Path, out: pathlib.Path, rename=None, drop=(), add=None, config=None) -> None:
  """Copies a single-file checkpoint, renaming / dropping / adding tensors and replacing config.json."""
  tensors = load_file(str(folder / "model.safetensors"))
  rename = rename or (lambda name: name)
  new = {rename(name): value for name, value in tensors.items() if name not in drop}
  new.update(add or {})
  out.mkdir(parents=True, exist_ok=True)
  save_file(new, str(out / "model.safetensors"))
  raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
  (out / "config.json").write_text(json.dumps(config(raw) if config else raw), encoding="utf-8")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """`make(case, **save_kwargs) -> (folder, torch model)`, cached per session."""
  cache: dict[tuple, tuple[pathlib.Path, Any]] = {}

  def make(case: str, **save_kwargs: Any) -> tuple[pathlib.Path, Any]:
    key = (case, tuple(sorted(save_kwargs.items())))
    if key not in cache:
      model = build_hf_model(case)
      folder = tmp_path_factory.mktemp(case)
      model.save_pretrained(str(folder), **save_kwargs)
      cache[key] = (folder, model)
    return cache[key]

  return make


@pytest.fixture
def rewrite_checkpoint():
  """`rewrite(folder, out, rename=None, drop=(), add=None, config=None)`: a modified copy of a checkpoint."""
  return _rewrite_checkpoint


@pytest.fixture
def random_tokens():
  """`make(length, seed=0) -> [1, length] int32` random ids below vocab 512."""

  def make(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, size=(1, length), dtype=np.int32)

  return make
