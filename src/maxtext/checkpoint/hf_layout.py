"""Which Hugging Face tensors make which canonical parameters, and how they are re-laid-out: the recipes the model's
parameters declare.

Every module declares its parameters beside their code (`declare`, `maxtext.layers.declarations`): the logical
axes and the Hugging Face tensors that fill each one, through the re-layouts of `maxtext.layers.tensor_sources`
(and the few a single family's checkpoints use, beside the layer that owns them: Qwen3-Next's grouped
`in_proj_qkvz` in `layers/gated_delta_net.py`, gpt-oss's interleaved experts and Granite 4.0's fused ones in
`layers/moe.py`, Granite's fused MLP in `layers/mlp.py`). `Transformer.declare` nests them under canonical and
Hugging Face names, in the family's tensor layout (`TensorLayout`: norm names, feed-forward and delta net
projection layouts); here they become the recipes the safetensors and GGUF readers run.
"""

from collections.abc import Collection
from typing import Any

from maxtext.layers.declarations import recipes
from maxtext.layers.tensor_sources import Recipe
from maxtext.models.transformer import Transformer

__all__ = ["Recipe", "build_recipes"]


def build_recipes(cfg: Any, available: Collection[str] = ()) -> list[Recipe]:
  """Every recipe of a model config, in layer order.

  Args:
    cfg: a loaded config (`maxtext.configs.load_config`), with derived values.
    available: normalised names present in the checkpoint (selects the per-expert or fused MoE layout).

  Returns:
    The recipes; together their targets are every canonical parameter of the model.

  Raises:
    NotImplementedError: the config asks for a layout no Hugging Face checkpoint of these families has, or a
      parameter (of a layer kind) without a checkpoint source.
  """
  return recipes(Transformer.declare(cfg, available))
