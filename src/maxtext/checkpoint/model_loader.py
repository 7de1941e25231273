"""Build a model from a config: from an Orbax checkpoint, a Hugging Face folder, a GGUF file, or random init."""

import logging
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
from flax import nnx

from maxtext.checkpoint import gguf, hf, orbax
from maxtext.configs import ConfigError, load_config
from maxtext.configs.loader import DEFAULT_MODEL_NAME
from maxtext.models import Transformer, abstract_model, assign_params

logger = logging.getLogger(__name__)

# The keys that say where a model's keys come from (a model YAML may name a checkpoint).
SOURCE_KEYS = ("model_name", "hf_model_path", "gguf_model_path")


def load_model(
    cfg: ml_collections.FrozenConfigDict, *, progress: bool = True, into: Transformer | None = None
) -> Transformer:
  """The model of `cfg` with its parameters.

  Sources, first set wins: `load_parameters_path` (Orbax checkpoint, e.g. from scripts/convert_hf_checkpoint.py),
  `hf_model_path` (Hugging Face folder, streamed), `gguf_model_path` (GGUF file, dequantized tensor by tensor),
  else random initialisation from `init_seed`.

  Args:
    cfg: a loaded config whose model keys match the checkpoint (e.g. `hf.load_hf_config` or
      `convert.load_converted_config`).
    progress: show a progress bar while reading a Hugging Face folder.
    into: a model of `cfg` (e.g. `abstract_model(cfg)`, which takes a trace of the whole model to build) whose
      parameters a Hugging Face or GGUF source replaces in place; None builds one.

  Returns:
    The model, parameters in `cfg.weight_dtype`.
  """
  if cfg.load_parameters_path:
    logger.info("restoring parameters from %s", cfg.load_parameters_path)
    return orbax.restore_model(cfg.load_parameters_path, cfg)
  if cfg.hf_model_path:
    model = abstract_model(cfg) if into is None else into
    assign_params(model, hf.iter_hf_params(cfg.hf_model_path, cfg, progress=progress))
    return model
  if cfg.gguf_model_path:
    model = abstract_model(cfg) if into is None else into
    assign_params(model, gguf.iter_gguf_params(cfg.gguf_model_path, cfg, progress=progress))
    return model
  logger.info("no checkpoint configured: random initialisation (init_seed=%d)", cfg.init_seed)
  return Transformer(cfg, rngs=nnx.Rngs(cfg.init_seed))


def load_run_config(argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
  """`load_config`, except that a configured `hf_model_path` or `gguf_model_path` supplies the model keys.

  Order (later wins): base.yml, `models/<model_name>.yml`, the Hugging Face config.json (when `hf_model_path` is
  set) or the GGUF metadata (when `gguf_model_path` is set), then `argv`'s `key=value` items and `overrides`.

  Raises:
    ConfigError: a bad key or value, both hf_model_path and gguf_model_path set, `hf_model_path` together with
      `model_name` (both name the model), or `hf_model_path` a file; FileNotFoundError: `hf_model_path` has no
      config.json or `gguf_model_path` does not exist; NotImplementedError: an unsupported architecture;
      GGUFError: an unreadable GGUF file.
  """
  # Where the model keys come from is read first from the source keys alone: the other overrides (e.g.
  # num_kv_shared_layers=2) are validated once, against the model the checkpoint describes, not base.yml's.
  cfg = load_config(_source_argv(argv), **{k: v for k, v in overrides.items() if k in SOURCE_KEYS})
  if cfg.hf_model_path and cfg.gguf_model_path:
    raise ConfigError(
        f"hf_model_path={cfg.hf_model_path!r} and gguf_model_path={cfg.gguf_model_path!r} are both set; set one"
        " (the model keys come from either)"
    )
  if cfg.gguf_model_path:
    return gguf.load_gguf_config(cfg.gguf_model_path, argv, **overrides)
  if not cfg.hf_model_path:
    return load_config(argv, **overrides)
  check_hf_model_source(cfg)
  return hf.load_hf_config(cfg.hf_model_path, argv, **overrides)


def _source_argv(argv: Sequence[str]) -> list[str]:
  """argv's base YAML (if any) and its `key=value` items of the source keys only."""
  args = list(argv)
  head = [args.pop(0)] if args and "=" not in args[0] else []
  return head + [arg for arg in args if "=" in arg and arg.split("=", 1)[0].strip() in SOURCE_KEYS]


def check_hf_model_source(cfg: ml_collections.FrozenConfigDict) -> None:
  """Raises when `hf_model_path` cannot be the model's source: a file, or set together with `model_name`.

  Raises:
    ConfigError: naming both keys, or saying the path is not a folder.
  """
  path = cfg.hf_model_path
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(
        f"hf_model_path={path!r} is a file, not a folder; give the Hugging Face folder holding config.json,"
        " *.safetensors and tokenizer.json"
    )
  if cfg.model_name != DEFAULT_MODEL_NAME:
    raise ConfigError(
        f"hf_model_path={path!r} and model_name={cfg.model_name!r} both name the model; set one (the model keys"
        " come from the folder's config.json, so model_name would be ignored)"
    )
