"""Qwen3.5: Qwen3-Next's block with the delta net projections stored flat (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`). Hugging Face `qwen3_5_text` (dense) and `qwen3_5_moe_text` (every layer MoE), and their
multimodal wrappers `qwen3_5` and `qwen3_5_moe`."""

from typing import Any

from maxtext.configs.families.family import Family, HFMapping
from maxtext.configs.families.hf_fields import HFFields
from maxtext.configs.families.qwen3_next import GDN_TRAITS, gdn_layer_types, gdn_overrides, moe_overrides
from maxtext.configs.layer_kinds import LINEAR_ATTENTION

_GDN_DEFAULTS = {
    "num_attention_heads": 16,
    "head_dim": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "max_position_embeddings": 32768,
}
_MOE_TEXT_TYPE = "qwen3_5_moe_text"


def _overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  del hidden  # the shape keys are mapped for every family
  out = gdn_overrides(fields, layer_types)
  if fields.model_type == _MOE_TEXT_TYPE:
    out.update(moe_overrides(fields, reads_norm_topk_prob=False))
  return out


FAMILY = Family(
    name="qwen3_5",
    cycle_kind=LINEAR_ATTENTION,
    owned_kinds=(LINEAR_ATTENTION,),
    traits=GDN_TRAITS,
    hf=HFMapping(
        model_types={
            "qwen3_5_text": {
                **_GDN_DEFAULTS,
                "vocab_size": 248320,
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 32,
                "num_key_value_heads": 4,
            },
            _MOE_TEXT_TYPE: {
                **_GDN_DEFAULTS,
                "vocab_size": 248320,
                "hidden_size": 2048,
                "num_hidden_layers": 40,
                "num_key_value_heads": 2,
                "num_experts": 256,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
            },
        },
        multimodal_types={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": _MOE_TEXT_TYPE},
        layer_types=gdn_layer_types,
        overrides=_overrides,
    ),
)
