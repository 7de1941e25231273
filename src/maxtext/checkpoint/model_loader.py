"""Build a model from a config: from an Orbax checkpoint, a Hugging Face folder, or random initialisation."""

import logging
from collections.abc import Sequence
from typing import Any

import ml_collections
from flax import nnx

from maxtext.checkpoint import hf, orbax
from maxtext.configs import load_config
from maxtext.models import Transformer, abstract_model, assign_params

logger = logging.getLogger(__name__)


def load_model(cfg: ml_collections.FrozenConfigDict, *, progress: bool = True) -> Transformer:
  """The model of `cfg` with its parameters.

  Sources, first set wins: `load_parameters_path` (Orbax checkpoint, e.g. from scripts/convert_hf_checkpoint.py),
  `hf_model_path` (Hugging Face folder, streamed), else random initialisation from `init_seed`.

  Args:
    cfg: a loaded config whose model keys match the checkpoint (e.g. `hf.load_hf_config` or
      `convert.load_converted_config`).
    progress: show a progress bar while reading a Hugging Face folder.

  Returns:
    The model, parameters in `cfg.weight_dtype`.
  """
  if cfg.load_parameters_path:
    logger.info("restoring parameters from %s", cfg.load_parameters_path)
    return orbax.restore_model(cfg.load_parameters_path, cfg)
  if cfg.hf_model_path:
    model = abstract_model(cfg)
    assign_params(model, hf.iter_hf_params(cfg.hf_model_path, cfg, progress=progress))
    return model
  logger.info("no checkpoint configured: random initialisation (init_seed=%d)", cfg.init_seed)
  return Transformer(cfg, rngs=nnx.Rngs(cfg.init_seed))


def load_run_config(argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
  """`load_config`, except that a configured `hf_model_path` supplies the model keys from its config.json.

  Order (later wins): base.yml, `models/<model_name>.yml`, the Hugging Face config.json (when `hf_model_path` is
  set), then `argv`'s `key=value` items and `overrides`.

  Raises:
    ConfigError: a bad key or value; FileNotFoundError: `hf_model_path` has no config.json;
    NotImplementedError: an unsupported Hugging Face architecture.
  """
  cfg = load_config(argv, **overrides)
  if not cfg.hf_model_path:
    return cfg
  return hf.load_hf_config(cfg.hf_model_path, argv, **overrides)
