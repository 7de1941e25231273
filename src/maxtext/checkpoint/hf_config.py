"""Map a Hugging Face `config.json` to this package's config keys (configs/base.yml names).

Supported model types are those the families of `maxtext.configs.families` map (each family module holds its
model types, their transformers defaults, its layer pattern and its own keys): llama, qwen3, gemma3_text,
qwen3_next, qwen3_5_text, qwen3_5_moe_text, granitemoehybrid (Granite 4.0), bamba, gpt_oss, and the multimodal
wrappers gemma3, qwen3_5 and qwen3_5_moe (their `text_config` is used; vision fields are ignored). Fields absent
from the file take the default of the corresponding transformers config class (Hub configs, e.g. Gemma3's
`text_config`, rely on those defaults). Both the v5 `rope_parameters` dict (per layer type for the families that
give it so, Gemma3) and the legacy top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` /
`rope_local_base_freq` fields are accepted.
"""

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from maxtext.configs import families
from maxtext.configs.families.hf_fields import HFFields

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """Reads `config.json` of a local Hugging Face folder (or the file itself).

  Raises:
    FileNotFoundError: the folder or its config.json does not exist.
    ValueError: the file is not a JSON object.
  """
  path = os.fspath(path)
  config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.exists(path):
    raise FileNotFoundError(f"Hugging Face model folder {path!r} does not exist")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"Hugging Face model folder {path!r} has no config.json")
  with open(config_path, encoding="utf-8") as f:
    try:
      raw = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path} is not valid JSON: {e}") from e
  if not isinstance(raw, dict):
    raise ValueError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
  return raw


def supported_model_types() -> tuple[str, ...]:
  """Every Hugging Face model_type (text or multimodal) a registered family maps, sorted."""
  return tuple(sorted(set(families.hf_text_model_types()) | set(families.hf_multimodal_model_types())))


def _text_config(hf_config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
  """Returns (text config dict, text model_type) of a text-only or multimodal config."""
  model_type = hf_config.get("model_type")
  # Asked of the registry on each call: a family registered after import maps its model types too.
  multimodal_text_types = families.hf_multimodal_model_types()
  if model_type in multimodal_text_types:
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError(f"Hugging Face config of multimodal model_type {model_type!r} must have a text_config object")
    text_type = text.get("model_type", multimodal_text_types[model_type])
    if text_type != multimodal_text_types[model_type]:
      raise NotImplementedError(
          f"text_config.model_type {text_type!r} of a {model_type!r} model is not supported "
          f"(expected {multimodal_text_types[model_type]!r})"
      )
    return text, text_type
  if model_type not in families.hf_text_model_types():
    raise NotImplementedError(
        f"Hugging Face model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})"
    )
  return hf_config, model_type


def _scaling_overrides(scaling: Mapping[str, Any], where: str, fields: HFFields) -> dict[str, Any]:
  """rope_type and its scaling keys from one rope parameter dict."""
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise NotImplementedError(
        f"rope type {rope_type!r} ({where}) of Hugging Face model_type {fields.model_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )
  out: dict[str, Any] = {"rope_type": rope_type}
  if rope_type in ("linear", "llama3"):
    out["rope_scaling_factor"] = float(scaling["factor"])
  if rope_type == "llama3":
    out["rope_low_freq_factor"] = float(scaling.get("low_freq_factor", 1.0))
    out["rope_high_freq_factor"] = float(scaling.get("high_freq_factor", 4.0))
    original = scaling.get("original_max_position_embeddings", fields.get("max_position_embeddings"))
    out["rope_original_max_position_embeddings"] = int(original)
  if rope_type == "yarn":
    unsupported = [k for k in ("mscale", "mscale_all_dim") if scaling.get(k)]
    if unsupported:
      raise NotImplementedError(f"yarn rope scaling with {', '.join(unsupported)} ({where}) is not supported")
    factor = scaling.get("factor")
    original = int(scaling.get("original_max_position_embeddings") or fields.get("max_position_embeddings"))
    if factor is None:  # transformers: the ratio of the context lengths
      factor = fields.require("max_position_embeddings") / original
    out["rope_scaling_factor"] = float(factor)
    out["rope_original_max_position_embeddings"] = original
    out["rope_beta_fast"] = float(scaling.get("beta_fast") or 32.0)
    out["rope_beta_slow"] = float(scaling.get("beta_slow") or 1.0)
    out["rope_truncate"] = bool(scaling.get("truncate", True))
    out["rope_attention_factor"] = float(scaling.get("attention_factor") or 0.0)
  return out


def _rope_overrides(fields: HFFields, family: families.Family) -> dict[str, Any]:
  """RoPE keys from `rope_parameters` (v5) or the legacy top-level fields (per layer type for families that give
  them so)."""
  text = fields.text
  params = text.get("rope_parameters")
  legacy_scaling = text.get("rope_scaling")
  if family.hf.rope_per_layer_type:
    is_nested = isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params)
    nested = dict(params) if is_nested else {}
    full = dict(nested.get("full_attention") or {})
    sliding = dict(nested.get("sliding_attention") or {})
    if legacy_scaling:
      full.update(legacy_scaling)
    full.setdefault("rope_theta", fields.get("rope_theta"))
    sliding.setdefault("rope_theta", fields.get("rope_local_base_freq"))
    out = _scaling_overrides(full, "rope_parameters.full_attention", fields)
    local = _scaling_overrides(sliding, "rope_parameters.sliding_attention", fields)
    if local["rope_type"] != "default":
      raise NotImplementedError(
          f"rope type {local['rope_type']!r} on sliding_attention layers of Hugging Face model_type "
          f"{fields.model_type!r} is not supported (sliding layers use unscaled RoPE)"
      )
    out["rope_max_timescale"] = float(full["rope_theta"])
    out["local_rope_max_timescale"] = float(sliding["rope_theta"])
    out["partial_rotary_factor"] = float(full.get("partial_rotary_factor", 1.0))
    return out
  rope = dict(legacy_scaling or fields.get("rope_parameters") or {})  # absent: the model type's default (gpt_oss)
  rope.setdefault("rope_theta", fields.get("rope_theta"))
  rope.setdefault("partial_rotary_factor", fields.get("partial_rotary_factor") or 1.0)
  out = _scaling_overrides(rope, "rope_parameters", fields)
  theta = float(rope["rope_theta"])
  out["rope_max_timescale"] = theta
  out["local_rope_max_timescale"] = theta
  out["partial_rotary_factor"] = float(rope["partial_rotary_factor"])
  return out


def _activation(fields: HFFields, key: str) -> str:
  act = fields.require(key)
  if act not in _ACTIVATIONS:
    raise NotImplementedError(
        f"activation {key}={act!r} of Hugging Face model_type {fields.model_type!r} is not supported "
        f"(supported: {', '.join(sorted(_ACTIVATIONS))})"
    )
  return _ACTIVATIONS[act]


def hf_config_to_overrides(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """Maps a parsed Hugging Face config.json to overrides for `maxtext.configs.load_config(**overrides)`.

  The keys every family has (shape, norm, activation, RoPE, layer kinds) are mapped here; the family of the
  model type (`maxtext.configs.families`) supplies its defaults, its layer pattern and its own keys.

  Args:
    hf_config: the JSON object of config.json.

  Returns:
    A dict of base.yml keys (model shape, norms, RoPE, layer kinds, GDN, Mamba2 and MoE fields).

  Raises:
    NotImplementedError: unsupported model_type, rope type, activation or feature.
    ValueError: a required field is missing or inconsistent.
  """
  text, model_type = _text_config(hf_config)
  family = families.family_of_hf_model_type(model_type)
  fields = HFFields(text, model_type, family.hf.model_types[model_type])
  if fields.get("use_bidirectional_attention"):
    raise NotImplementedError(f"use_bidirectional_attention=true of Hugging Face model_type {model_type!r}")
  hidden = int(fields.require("hidden_size"))
  num_heads = int(fields.require("num_attention_heads"))
  num_layers = int(fields.require("num_hidden_layers"))
  num_kv_heads = fields.get("num_key_value_heads")
  head_dim = fields.get("head_dim")
  # Multimodal wrappers keep tie_word_embeddings at the top level; it wins over the text_config value.
  tie = hf_config["tie_word_embeddings"] if "tie_word_embeddings" in hf_config else fields.get("tie_word_embeddings")
  attention_bias = bool(fields.get("attention_bias"))
  if attention_bias and family.traits.attention_output_gate:
    raise NotImplementedError(
        f"attention_bias=true of Hugging Face model_type {model_type!r} is not supported "
        "(the gated q_proj output gate has no bias)"
    )
  overrides: dict[str, Any] = {
      "decoder_block": family.name,
      "base_emb_dim": hidden,
      "base_num_decoder_layers": num_layers,
      "base_num_query_heads": num_heads,
      "base_num_kv_heads": int(num_kv_heads) if num_kv_heads is not None else num_heads,
      "head_dim": int(head_dim) if head_dim is not None else hidden // num_heads,
      "vocab_size": int(fields.require("vocab_size")),
      "mlp_activations": [_activation(fields, family.hf.activation_key), "linear"],
      "normalization_layer_epsilon": float(fields.require("rms_norm_eps")),
      "logits_via_embedding": bool(tie),
      "attention_bias": attention_bias,
      "mlp_bias": bool(fields.get("mlp_bias")) if family.hf.reads_mlp_bias else False,
  }
  if fields.get("intermediate_size") is not None:
    overrides["base_mlp_dim"] = int(fields.get("intermediate_size"))
  layer_types = family.hf.layer_types(fields, num_layers)
  overrides["layer_types"] = layer_types
  if "sliding_attention" in layer_types:
    overrides["sliding_window_size"] = int(fields.require("sliding_window"))
  overrides.update(_rope_overrides(fields, family))
  if family.hf.overrides is not None:
    overrides.update(family.hf.overrides(fields, layer_types, hidden))
  logger.debug("Hugging Face %s config -> overrides %s", model_type, overrides)
  return overrides
