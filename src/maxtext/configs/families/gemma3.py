"""Gemma 3: sliding layers with a full attention layer every `inhomogeneous_layer_cycle_interval`, sandwich
zero-centred norms, QK norm, scaled embeddings, tanh-GELU; RoPE per layer type. Hugging Face `gemma3_text` (and
the multimodal `gemma3`, whose text_config is used), GGUF `gemma3` (NeoX rope, rows stored unpermuted)."""

from collections.abc import Callable, Mapping
from typing import Any

from maxtext.configs.families.family import Family, GGUFMapping, HFMapping, Traits
from maxtext.configs.families.hf_fields import HFFields, cycle_interval, cycled, given_layer_types
from maxtext.configs.layer_kinds import SLIDING_ATTENTION


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  given = given_layer_types(fields, num_layers)
  if given is not None:
    return given
  pattern = int(fields.text.get("sliding_window_pattern", fields.text.get("_sliding_window_pattern", 6)))
  return cycled(num_layers, pattern, SLIDING_ATTENTION)


def _overrides(fields: HFFields, layer_types: list[str], hidden: int) -> dict[str, Any]:
  del hidden  # the shape keys are mapped for every family
  return {
      "inhomogeneous_layer_cycle_interval": cycle_interval(layer_types, SLIDING_ATTENTION),
      "query_pre_attn_scalar": float(fields.require("query_pre_attn_scalar")),
      "final_logits_soft_cap": float(fields.get("final_logit_softcapping") or 0.0),
  }


def _gguf_config(require: Callable[[str], Any], config: Mapping[str, Any]) -> dict[str, Any]:
  """What llama.cpp's Gemma 3 code fixes instead of reading it from the file: 5 sliding layers to 1 full, RoPE base
  10,000 on sliding layers, and the query scale 1/sqrt(head_dim), except for the 62-layer (27B) model's
  1/sqrt(hidden / heads)."""
  if config["num_hidden_layers"] == 62:
    scalar = config["hidden_size"] // config["num_attention_heads"]
  else:
    scalar = config["head_dim"]
  return {
      "sliding_window": int(require("attention.sliding_window")),
      "sliding_window_pattern": 6,
      "rope_local_base_freq": 10_000.0,
      "query_pre_attn_scalar": scalar,
  }


FAMILY = Family(
    name="gemma3",
    cycle_kind=SLIDING_ATTENTION,
    traits=Traits(qk_norm=True, zero_centered_norm=True, sandwich_norm=True, embedding_scale=True),
    hf=HFMapping(
        model_types={
            "gemma3_text": {
                "vocab_size": 262208,
                "hidden_size": 2304,
                "intermediate_size": 9216,
                "num_hidden_layers": 26,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh",
                "tie_word_embeddings": True,
                "query_pre_attn_scalar": 256,
                "sliding_window": 4096,
                "sliding_window_pattern": 6,
                "final_logit_softcapping": None,
                "use_bidirectional_attention": False,
                "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0,
                "max_position_embeddings": 131072,
            }
        },
        multimodal_types={"gemma3": "gemma3_text"},
        layer_types=_layer_types,
        overrides=_overrides,
        # Gemma3 reads hidden_activation (its hidden_act field is unused by transformers).
        activation_key="hidden_activation",
        rope_per_layer_type=True,
    ),
    # llama.cpp's converter stores every (1 + w) norm weight as 1 + w; its names of the sandwich norms.
    gguf=(
        GGUFMapping(
            "gemma3",
            "gemma3_text",
            layer_names={
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
            },
            norm_shift=1.0,
            config=_gguf_config,
        ),
    ),
)
