"""maxtext.checkpoint: Hugging Face safetensors loading and conversion, Orbax save/restore."""

from typing import TYPE_CHECKING

from maxtext.checkpoint.hf import iter_hf_params, load_hf_config, load_hf_model, load_hf_params
from maxtext.checkpoint.model_loader import load_model, load_run_config

# Orbax, with tensorstore under it, takes about a fifth of a second to import: only a run that reads or writes an
# Orbax folder imports it, when it first asks for one of these names.
_ORBAX_NAMES = ("checkpoint_param_shapes", "restore_model", "restore_params", "save_params")
if TYPE_CHECKING:  # the names, for type checkers and linters
  from maxtext.checkpoint.orbax import checkpoint_param_shapes, restore_model, restore_params, save_params


def __getattr__(name: str):
  if name in _ORBAX_NAMES:
    from maxtext.checkpoint import orbax  # pylint: disable=import-outside-toplevel  # see _ORBAX_NAMES

    return getattr(orbax, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
