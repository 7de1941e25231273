"""maxtext.checkpoint: Hugging Face safetensors loading and conversion, Orbax save/restore."""

from maxtext.checkpoint.hf import iter_hf_params, load_hf_config, load_hf_model, load_hf_params
from maxtext.checkpoint.model_loader import load_model, load_run_config
from maxtext.checkpoint.orbax import checkpoint_param_shapes, restore_model, restore_params, save_params

__all__ = [
    "checkpoint_param_shapes",
    "iter_hf_params",
    "load_hf_config",
    "load_hf_model",
    "load_hf_params",
    "load_model",
    "load_run_config",
    "restore_model",
    "restore_params",
    "save_params",
]
