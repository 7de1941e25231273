"""Llama (decoder_block llama2): full attention, RMSNorm, a gated SiLU MLP; Hugging Face `llama`, GGUF `llama`."""

from maxtext.configs.families.family import Family, GGUFMapping, HFMapping
from maxtext.configs.families.hf_fields import HFFields, given_layer_types
from maxtext.configs.layer_kinds import FULL_ATTENTION


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  return given_layer_types(fields, num_layers) or [FULL_ATTENTION] * num_layers


FAMILY = Family(
    name="llama2",
    hf=HFMapping(
        model_types={
            "llama": {
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "rope_theta": 10000.0,
            }
        },
        layer_types=_layer_types,
        reads_mlp_bias=True,
    ),
    # llama.cpp's converter interleaves the rotary halves of q/k rows for its GPT-J style rope.
    gguf=(GGUFMapping("llama", "llama", permuted_rope_rows=True),),
)
