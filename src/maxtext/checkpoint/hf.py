"""Load a local Hugging Face folder (config.json + safetensors) into this package's config and parameters.

Families: Llama, Qwen3, Gemma3 (text and multimodal), Qwen3-Next (dense and MoE), Qwen3.5 (text, multimodal, MoE).
Tensors are streamed one at a time with `safetensors.safe_open`, re-laid-out to the canonical names of
docs/architecture.md (see `hf_layout`) and cast to `weight_dtype`; the full set of weights is never held twice.

    cfg = load_hf_config("/models/Qwen3-0.6B", dtype="bfloat16")
    for name, array in iter_hf_params("/models/Qwen3-0.6B", cfg): ...
    cfg, model = load_hf_model("/models/Qwen3-0.6B")
"""

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from maxtext.checkpoint import hf_config, hf_layout
from maxtext.checkpoint.safetensors_index import SafetensorsIndex
from maxtext.configs import load_config
from maxtext.models import Transformer, abstract_model, assign_params

logger = logging.getLogger(__name__)

_MAX_LISTED = 5


def _override_keys(argv: Sequence[str]) -> set[str]:
  return {arg.split("=", 1)[0].strip() for arg in argv if "=" in arg}


def load_hf_config(
    path: str | os.PathLike, argv: Sequence[str] = (), **overrides: Any
) -> ml_collections.FrozenConfigDict:
  """Loads the package config of a Hugging Face folder.

  The keys derived from config.json (`hf_config.hf_config_to_overrides`) override base.yml; `argv` (`key=value`
  strings, optionally a base YAML first) and `overrides` override both. `hf_model_path` is set to `path`.

  Args:
    path: a local folder with config.json.
    argv: MaxText-style arguments for `load_config`.
    **overrides: typed overrides for `load_config`, e.g. `weight_dtype="bfloat16"`.

  Returns:
    The loaded, validated config.

  Raises:
    FileNotFoundError: no such folder or no config.json.
    NotImplementedError: unsupported model_type or rope type.
    ConfigError: an override is unknown or inconsistent.
  """
  derived = hf_config.hf_config_to_overrides(hf_config.read_hf_config(path))
  derived["hf_model_path"] = os.fspath(path)
  given = _override_keys(argv) | set(overrides)
  merged = {k: v for k, v in derived.items() if k not in given}
  merged.update(overrides)
  return load_config(argv, **merged)


def _listing(names: Sequence[str]) -> str:
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _validate(index: SafetensorsIndex, recipes: list[hf_layout.Recipe], cfg: Any) -> None:
  """Checks every needed tensor exists with its expected shape and no tensor is left unused."""
  needed: set[str] = set()
  missing = []
  for recipe in recipes:
    targets = ", ".join(name for name, _ in recipe.targets)
    for source, shape in zip(recipe.sources, recipe.source_shapes):
      needed.add(source)
      if source not in index.tensors:
        missing.append(f"{source!r} (canonical {targets}, expected shape {shape})")
  if missing:
    raise ValueError(f"Hugging Face checkpoint {index.folder!r} is missing {len(missing)} tensors: {_listing(missing)}")
  if cfg.logits_via_embedding:
    needed.add("lm_head.weight")  # tied head: a stored copy is ignored, as transformers ties it to the embedding
  unexpected = sorted(f"{info.name!r} (shape {info.shape})" for key, info in index.tensors.items() if key not in needed)
  if unexpected:
    raise ValueError(
        f"Hugging Face checkpoint {index.folder!r} has {len(unexpected)} unexpected tensors that a "
        f"decoder_block={cfg.decoder_block!r} model with this config does not use: {_listing(unexpected)}"
    )
  if "lm_head.weight" in index.tensors and cfg.logits_via_embedding:
    logger.info("tied embeddings (logits_via_embedding): ignoring lm_head.weight of %s", index.folder)
  for recipe in recipes:
    for source, shape in zip(recipe.sources, recipe.source_shapes):
      info = index.tensors[source]
      if info.shape != shape:
        targets = ", ".join(name for name, _ in recipe.targets)
        raise ValueError(
            f"tensor {info.name!r} (canonical {targets}) in {os.path.basename(info.file)} has shape {info.shape}, "
            f"but the config expects {shape}"
        )


def _stream(
    index: SafetensorsIndex, recipes: list[hf_layout.Recipe], dtype: np.dtype, progress: bool
) -> Iterator[tuple[str, np.ndarray]]:
  total = sum(len(r.sources) for r in recipes)
  desc = f"Loading {os.path.basename(os.path.normpath(index.folder))}"
  with index, tqdm.tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not progress) as progress_bar:
    for recipe in recipes:
      arrays = recipe.convert(lambda j, r=recipe: index.read(r.sources[j]), dtype)
      progress_bar.update(len(recipe.sources))
      for (name, shape), array in zip(recipe.targets, arrays):
        assert array.shape == shape and array.dtype == dtype, (name, array.shape, shape, array.dtype)
        yield name, array


def iter_hf_params(
    path: str | os.PathLike, cfg: ml_collections.FrozenConfigDict, *, progress: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
  """Streams the canonical parameters of a Hugging Face folder, one at a time, in `cfg.weight_dtype`.

  Every tensor's presence and shape is checked (from the file headers) before the first one is loaded.

  Args:
    path: a local folder with one or more safetensors files (a sharded `model.safetensors.index.json` included).
    cfg: the config of the model (e.g. from `load_hf_config`).
    progress: show a tqdm progress bar on stderr.

  Returns:
    An iterator of (canonical name, array); arrays are numpy, C-contiguous, of dtype `cfg.weight_dtype`.

  Raises:
    FileNotFoundError: no such folder or no safetensors files.
    ValueError: a tensor is missing, unexpected or mis-shaped (naming the Hugging Face and canonical names and
      both shapes), or a name appears twice.
  """
  index = SafetensorsIndex(path)
  try:
    recipes = hf_layout.build_recipes(cfg, index.tensors.keys())
    _validate(index, recipes, cfg)
  except BaseException:
    index.close()
    raise
  return _stream(index, recipes, np.dtype(jnp.dtype(cfg.weight_dtype)), progress)


def load_hf_params(
    path: str | os.PathLike, cfg: ml_collections.FrozenConfigDict, *, progress: bool = False
) -> dict[str, np.ndarray]:
  """All canonical parameters of a Hugging Face folder as {name: numpy array} (see `iter_hf_params`)."""
  return dict(iter_hf_params(path, cfg, progress=progress))


def load_hf_model(
    path: str | os.PathLike, *, progress: bool = True, **overrides: Any
) -> tuple[ml_collections.FrozenConfigDict, Transformer]:
  """Builds the model of a Hugging Face folder and fills it with the checkpoint's weights.

  The model is created abstractly (no random initialisation), then every parameter is assigned from the stream.

  Args:
    path: a local Hugging Face folder.
    progress: show a tqdm progress bar on stderr.
    **overrides: config overrides (see `load_hf_config`).

  Returns:
    (config, model).
  """
  cfg = load_hf_config(path, **overrides)
  model = abstract_model(cfg)
  assign_params(model, iter_hf_params(path, cfg, progress=progress))
  logger.info("loaded %s (%s) from %s", cfg.decoder_block, cfg.weight_dtype, os.fspath(path))
  return cfg, model
