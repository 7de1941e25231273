"""Qwen3-Next: gated delta net (linear_attention) layers with a gated full attention layer every
`inhomogeneous_layer_cycle_interval`, zero-centred norms, QK norm, routed experts with a gated shared expert.
Hugging Face `qwen3_next`; its delta net projections are grouped per key head (`in_proj_qkvz`, `in_proj_ba`).

`gdn_overrides` and `moe_overrides` are shared with Qwen3.5, which keeps these fields.
"""

from typing import Any

from maxtext.configs.families.family import GDN_GROUPED, Family, HFMapping, TensorLayout, Traits
from maxtext.configs.families.hf_fields import HFFields, cycle_interval, cycled, given_layer_types
from maxtext.configs.layer_kinds import LINEAR_ATTENTION

GDN_TRAITS = Traits(qk_norm=True, zero_centered_norm=True, attention_output_gate=True)


def gdn_layer_types(fields: HFFields, num_layers: int) -> list[str]:
  """The config's `layer_types`, else linear attention with full attention every `full_attention_interval`."""
  given = given_layer_types(fields, num_layers)
  if given is not None:
    return given
  return cycled(num_layers, int(fields.get("full_attention_interval")), LINEAR_ATTENTION)


def gdn_overrides(fields: HFFields, layer_types: list[str]) -> dict[str, Any]:
  """The cycle interval and the `gdn_*` keys."""
  return {
      "inhomogeneous_layer_cycle_interval": cycle_interval(layer_types, LINEAR_ATTENTION),
      "gdn_num_key_heads": int(fields.require("linear_num_key_heads")),
      "gdn_num_value_heads": int(fields.require("linear_num_value_heads")),
      "gdn_key_head_dim": int(fields.require("linear_key_head_dim")),
      "gdn_value_head_dim": int(fields.require("linear_value_head_dim")),
      "gdn_conv_kernel_dim": int(fields.require("linear_conv_kernel_dim")),
  }


def moe_overrides(fields: HFFields, *, reads_norm_topk_prob: bool) -> dict[str, Any]:
  """The MoE keys: routed experts and the gated shared expert (no experts: only `num_experts=0`).

  Args:
    fields: the config.
    reads_norm_topk_prob: the config has `norm_topk_prob` (Qwen3-Next); without it (Qwen3.5-MoE) every layer is
      MoE and the top-k probabilities are always renormalised.
  """
  out: dict[str, Any] = {"num_experts": int(fields.require("num_experts"))}
  if out["num_experts"] > 0:
    out["num_experts_per_tok"] = int(fields.require("num_experts_per_tok"))
    out["base_moe_mlp_dim"] = int(fields.require("moe_intermediate_size"))
    out["shared_expert_mlp_dim"] = int(fields.get("shared_expert_intermediate_size") or 0)
    out["norm_topk_prob"] = bool(fields.get("norm_topk_prob")) if reads_norm_topk_prob else True
    out["decoder_sparse_step"] = int(fields.get("decoder_sparse_step") or 1)
    out["mlp_only_layers"] = [int(i) for i in (fields.get("mlp_only_layers") or [])]
  return out


def _overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  del hidden  # the shape keys are mapped for every family
  return {**gdn_overrides(fields, layer_types), **moe_overrides(fields, reads_norm_topk_prob=True)}


FAMILY = Family(
    name="qwen3_next",
    cycle_kind=LINEAR_ATTENTION,
    owned_kinds=(LINEAR_ATTENTION,),
    traits=GDN_TRAITS,
    hf=HFMapping(
        model_types={
            "qwen3_next": {
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "head_dim": 256,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
                "full_attention_interval": 4,
                "num_experts": 512,
                "num_experts_per_tok": 10,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "max_position_embeddings": 32768,
            }
        },
        layer_types=gdn_layer_types,
        overrides=_overrides,
    ),
    tensors=TensorLayout(gdn_projections=GDN_GROUPED),
)
