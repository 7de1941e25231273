"""Granite 4.0 (decoder_block granite_hybrid): Mamba2 layers and full attention layers, scalar multipliers on the
embeddings, residuals, attention and logits, optional RoPE, and a shared MLP (with routed experts beside it when
the model has experts). Hugging Face `granitemoehybrid`; its MLPs are stored fused (`shared_mlp.input_linear`).

`MAMBA_LAYER_NAMES` and `mamba_hybrid_overrides` are shared with Bamba.
"""

from typing import Any

from maxtext.configs.families.family import FFN_GRANITE, Family, HFMapping, TensorLayout
from maxtext.configs.families.hf_fields import MAMBA2_DEFAULTS, HFFields, cycle_interval, mamba2_overrides
from maxtext.configs.layer_kinds import FULL_ATTENTION, MAMBA

# Hugging Face layer type names of the Mamba2 hybrids (transformers 5 names and the legacy ones) -> layer kinds.
MAMBA_LAYER_NAMES = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": FULL_ATTENTION,
    "attention": FULL_ATTENTION,
}


def mamba_hybrid_overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  """The cycle interval and the `mamba_*` keys of a Mamba2 hybrid."""
  return {"inhomogeneous_layer_cycle_interval": cycle_interval(layer_types, MAMBA), **mamba2_overrides(fields, hidden)}


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  """`layer_types` (or the legacy `layers_block_type`), every layer mamba when absent, as transformers does."""
  given = fields.text.get("layer_types", fields.text.get("layers_block_type"))
  if given is None:
    return [MAMBA] * num_layers
  if len(given) != num_layers or any(t not in MAMBA_LAYER_NAMES for t in given):
    raise ValueError(
        f"Hugging Face config layer_types of model_type {fields.model_type!r} must list {num_layers} entries from"
        f" {tuple(MAMBA_LAYER_NAMES)}, got {list(given)}"
    )
  return [MAMBA_LAYER_NAMES[t] for t in given]


def _overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  """The Mamba2 keys, the multipliers, optional RoPE and the MoE (softmax over the top-k logits, i.e. renormalised
  top-k probabilities) plus an ungated shared MLP; with no experts the shared MLP is the dense MLP."""
  out = mamba_hybrid_overrides(fields, layer_types, hidden)
  experts = int(fields.get("num_local_experts") or 0)
  out.update(
      {
          "embedding_multiplier": float(fields.require("embedding_multiplier")),
          "residual_multiplier": float(fields.require("residual_multiplier")),
          "attention_multiplier": float(fields.require("attention_multiplier")),
          "logits_scaling": float(fields.require("logits_scaling")),
          "use_rope": fields.get("position_embedding_type") == "rope",
          "num_experts": experts,
      }
  )
  if experts > 0:
    out["num_experts_per_tok"] = int(fields.require("num_experts_per_tok"))
    out["base_moe_mlp_dim"] = int(fields.require("intermediate_size"))
    out["shared_expert_mlp_dim"] = int(fields.require("shared_intermediate_size"))
    out["shared_expert_gate"] = False
    out["norm_topk_prob"] = True
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = []
  else:
    out["base_mlp_dim"] = int(fields.require("shared_intermediate_size"))
  return out


FAMILY = Family(
    name="granite_hybrid",
    cycle_kind=MAMBA,
    owned_kinds=(MAMBA,),
    hf=HFMapping(
        model_types={
            "granitemoehybrid": {
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "rope_theta": 10000.0,
                "embedding_multiplier": 1.0,
                "logits_scaling": 1.0,
                "residual_multiplier": 1.0,
                "attention_multiplier": 1.0,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "shared_intermediate_size": 1024,
                "position_embedding_type": None,
                **MAMBA2_DEFAULTS,
            }
        },
        layer_types=_layer_types,
        overrides=_overrides,
    ),
    tensors=TensorLayout(ffn=FFN_GRANITE),
)
