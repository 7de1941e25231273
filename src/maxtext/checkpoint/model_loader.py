"""Build a model from a config: from an Orbax checkpoint, a Hugging Face folder, a GGUF file, or random init."""

import logging
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
from flax import nnx

from maxtext.checkpoint import gguf, hf, orbax
from maxtext.configs import ConfigError, load_config
from maxtext.configs.loader import DEFAULT_MODEL_NAME, merge_layers
from maxtext.models import Transformer, abstract_model, assign_params

logger = logging.getLogger(__name__)


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
  # Only the source keys are read here: the other keys are validated together once the model keys are known, so
  # that e.g. prompt_token_ids is checked against the checkpoint's vocabulary, not base.yml's.
  values = merge_layers(argv, **overrides)
  hf_path, gguf_path = values["hf_model_path"], values["gguf_model_path"]
  if hf_path and gguf_path:
    raise ConfigError(
        f"hf_model_path={hf_path!r} and gguf_model_path={gguf_path!r} are both set; set one"
        " (the model keys come from either)"
    )
  if gguf_path:
    return gguf.load_gguf_config(gguf_path, argv, **overrides)
  if not hf_path:
    return load_config(argv, **overrides)
  check_hf_model_source(hf_path, values["model_name"])
  return hf.load_hf_config(hf_path, argv, **overrides)


def check_hf_model_source(path: str, model_name: str) -> None:
  """Raises when `hf_model_path` cannot be the model's source: a file, or set together with `model_name`.

  Raises:
    ConfigError: naming both keys, or saying the path is not a folder.
  """
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(
        f"hf_model_path={path!r} is a file, not a folder; give the Hugging Face folder holding config.json,"
        " *.safetensors and tokenizer.json"
    )
  if model_name != DEFAULT_MODEL_NAME:
    raise ConfigError(
        f"hf_model_path={path!r} and model_name={model_name!r} both name the model; set one (the model keys"
        " come from the folder's config.json, so model_name would be ignored)"
    )
