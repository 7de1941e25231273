"""gpt-oss: sliding and full attention layers alternating, attention sinks and biases, one (yarn) RoPE for every
layer, routed experts on every layer with biased router and experts and the clamped SwiGLU. Hugging Face
`gpt_oss`; its experts store gate and up interleaved along the last axis."""

from collections.abc import Mapping
from typing import Any

from maxtext.configs.errors import ConfigError
from maxtext.configs.families.family import Family, HFMapping, Traits
from maxtext.configs.families.hf_fields import HFFields, cycle_interval, cycled, given_layer_types
from maxtext.configs.layer_kinds import SLIDING_ATTENTION


def _check(values: Mapping[str, Any]) -> None:
  """Clamped SwiGLU experts on every layer, softmax over the top-k router logits."""
  for key in ("swiglu_alpha", "swiglu_limit"):
    if values[key] <= 0:
      raise ConfigError(f"{key}={values[key]!r}: must be > 0 for decoder_block=gpt_oss")
  if values["num_experts"] <= 0:
    raise ConfigError(
        f"num_experts={values['num_experts']!r}: must be > 0 for decoder_block=gpt_oss (every layer is MoE)"
    )
  if not values["norm_topk_prob"]:
    raise ConfigError("norm_topk_prob=False: must be true for decoder_block=gpt_oss (softmax over the top-k logits)")
  if values["shared_expert_mlp_dim"] or values["mlp_only_layers"] or values["decoder_sparse_step"] != 1:
    raise ConfigError(
        "decoder_block=gpt_oss has routed experts on every layer: shared_expert_mlp_dim must be 0, mlp_only_layers"
        f" empty and decoder_sparse_step 1 (got {values['shared_expert_mlp_dim']}, {list(values['mlp_only_layers'])},"
        f" {values['decoder_sparse_step']})"
    )


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  given = given_layer_types(fields, num_layers)
  return given if given is not None else cycled(num_layers, 2, SLIDING_ATTENTION)


def _overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  """MoE on every layer (softmax over the top-k router logits), the clamped SwiGLU, the full/sliding cycle."""
  del hidden  # the shape keys are mapped for every family
  return {
      "num_experts": int(fields.require("num_local_experts")),
      "num_experts_per_tok": int(fields.require("num_experts_per_tok")),
      "base_moe_mlp_dim": int(fields.require("intermediate_size")),
      "norm_topk_prob": True,
      "swiglu_alpha": float(fields.require("swiglu_alpha")),
      "swiglu_limit": float(fields.require("swiglu_limit")),
      "inhomogeneous_layer_cycle_interval": cycle_interval(layer_types, SLIDING_ATTENTION),
  }


FAMILY = Family(
    name="gpt_oss",
    cycle_kind=SLIDING_ATTENTION,
    traits=Traits(attention_sinks=True, moe_bias=True, clamped_swiglu=True, global_rope_on_sliding=True),
    hf=HFMapping(
        model_types={
            "gpt_oss": {
                "vocab_size": 201088,
                "hidden_size": 2880,
                "intermediate_size": 2880,
                "num_hidden_layers": 36,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "num_local_experts": 128,
                "num_experts_per_tok": 4,
                "sliding_window": 128,
                "rms_norm_eps": 1e-5,
                "attention_bias": True,
                "swiglu_alpha": 1.702,
                "swiglu_limit": 7.0,
                "rope_theta": 150000.0,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
                "max_position_embeddings": 131072,
            }
        },
        layer_types=_layer_types,
        overrides=_overrides,
    ),
    check=_check,
)
