"""Bamba: Mamba2 layers with full attention at `attn_layer_indices`, a dense gated MLP under `feed_forward.`, the
pre-MLP norm named `pre_ff_layernorm` and the final one `final_layernorm`. Hugging Face `bamba`."""

from maxtext.configs.families.family import FFN_FEED_FORWARD, Family, HFMapping, TensorLayout
from maxtext.configs.families.granite_hybrid import mamba_hybrid_overrides
from maxtext.configs.families.hf_fields import MAMBA2_DEFAULTS, HFFields
from maxtext.configs.layer_kinds import FULL_ATTENTION, MAMBA


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  """Full attention at `attn_layer_indices`, mamba elsewhere."""
  indices = fields.get("attn_layer_indices") or []
  if any(not 0 <= int(i) < num_layers for i in indices):
    raise ValueError(f"Hugging Face config attn_layer_indices must be layers in [0, {num_layers}), got {indices}")
  return [FULL_ATTENTION if i in {int(j) for j in indices} else MAMBA for i in range(num_layers)]


FAMILY = Family(
    name="bamba",
    cycle_kind=MAMBA,
    owned_kinds=(MAMBA,),
    hf=HFMapping(
        model_types={
            "bamba": {
                "vocab_size": 128000,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 262144,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "attn_layer_indices": None,
                **MAMBA2_DEFAULTS,
            }
        },
        layer_types=_layer_types,
        overrides=mamba_hybrid_overrides,
        reads_mlp_bias=True,
    ),
    tensors=TensorLayout(
        pre_mlp_norm="pre_ff_layernorm", final_norm="model.final_layernorm.weight", ffn=FFN_FEED_FORWARD
    ),
)
