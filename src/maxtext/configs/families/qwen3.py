"""Qwen3: Llama's block plus RMSNorm on every query and key head; optional sliding layers from
`max_window_layers` on. Hugging Face `qwen3`, GGUF `qwen3` (NeoX rope, rows stored unpermuted)."""

from maxtext.configs.families.family import Family, GGUFMapping, HFMapping, Traits
from maxtext.configs.families.hf_fields import HFFields, given_layer_types
from maxtext.configs.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  given = given_layer_types(fields, num_layers)
  if given is not None:
    return given
  if fields.get("use_sliding_window") and fields.get("sliding_window") is not None:
    first_sliding = int(fields.get("max_window_layers"))
    return [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
  return [FULL_ATTENTION] * num_layers


FAMILY = Family(
    name="qwen3",
    traits=Traits(qk_norm=True),
    hf=HFMapping(
        model_types={
            "qwen3": {
                "vocab_size": 151936,
                "hidden_size": 4096,
                "intermediate_size": 22016,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "head_dim": 128,
                "rope_theta": 10000.0,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": 28,
                "max_position_embeddings": 32768,
            }
        },
        layer_types=_layer_types,
    ),
    gguf=(GGUFMapping("qwen3", "qwen3"),),
)
