"""maxtext.models: the hybrid decoder and flat parameter access."""

from maxtext.models.params import assign_params, flat_param_shapes, get_flat_params
from maxtext.models.transformer import Transformer, abstract_model

__all__ = ["Transformer", "abstract_model", "assign_params", "flat_param_shapes", "get_flat_params"]
