"""Build a model from a config: from an Orbax checkpoint, a Hugging Face folder, a GGUF file, or random init."""

import logging
from collections.abc import Sequence
from typing import Any

import ml_collections
from flax import nnx

from maxtext.checkpoint import source
from maxtext.configs import load_config
from maxtext.configs.loader import merge_layers_with_origins
from maxtext.models import Transformer

logger = logging.getLogger(__name__)


def load_model(
    cfg: ml_collections.FrozenConfigDict, *, progress: bool = True, into: Transformer | None = None
) -> Transformer:
  """The model of `cfg` with its parameters.

  The tensors come from `source.weights_source(cfg)`: `load_parameters_path` (Orbax checkpoint, e.g. from
  scripts/convert_hf_checkpoint.py) when set, else `hf_model_path` (Hugging Face folder, streamed) or
  `gguf_model_path` (GGUF file, dequantized tensor by tensor), else random initialisation from `init_seed`.

  Args:
    cfg: a loaded config whose model keys match the checkpoint (e.g. `hf.load_hf_config` or
      `convert.load_converted_config`).
    progress: show a progress bar while reading a Hugging Face folder.
    into: a model of `cfg` (e.g. `abstract_model(cfg)`, which takes a trace of the whole model to build) whose
      parameters a Hugging Face or GGUF source replaces in place; None builds one.

  Returns:
    The model, parameters in `cfg.weight_dtype`.

  Raises:
    ConfigError: both hf_model_path and gguf_model_path are set.
  """
  weights = source.weights_source(cfg)
  if weights is not None:
    return weights.load_model(cfg, progress=progress, into=into)
  logger.info("no checkpoint configured: random initialisation (init_seed=%d)", cfg.init_seed)
  return Transformer(cfg, rngs=nnx.Rngs(cfg.init_seed))


def load_run_config(argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
  """`load_config`, except that a configured `hf_model_path` or `gguf_model_path` (`source.model_source`) supplies
  the model keys.

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
  values, origins = merge_layers_with_origins(argv, **overrides)
  model = source.model_source(values, origins)
  if model is None:
    return load_config(argv, **overrides)
  model.check_run_config(values)
  return model.load_config(argv, **overrides)
