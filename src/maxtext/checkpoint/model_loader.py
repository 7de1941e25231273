"""Build a model from a config: from an Orbax checkpoint, a Hugging Face folder, or random initialisation."""

import logging

import ml_collections
from flax import nnx

from maxtext.checkpoint import hf, orbax
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
