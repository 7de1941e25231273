"""Map a Hugging Face `config.json` to this package's config keys (configs/base.yml names).

Supported model types: llama, qwen3, gemma3_text, qwen3_next, qwen3_5_text, qwen3_5_moe_text, granitemoehybrid
(Granite 4.0), bamba, gpt_oss, and the multimodal wrappers gemma3, qwen3_5 and qwen3_5_moe (their `text_config` is
used; vision fields are ignored). Fields absent from the file take the default of the corresponding transformers
config class (Hub configs, e.g. Gemma3's `text_config`, rely on those defaults). Both the v5 `rope_parameters` dict
(per layer type for Gemma3) and the legacy top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` /
`rope_local_base_freq` fields are accepted.
"""

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from maxtext.checkpoint.hf_layout import MIXER_RECIPES

logger = logging.getLogger(__name__)

# text model_type -> decoder_block
DECODER_BLOCKS: dict[str, str] = {
    "llama": "llama2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "granitemoehybrid": "granite_hybrid",
    "bamba": "bamba",
    "gpt_oss": "gpt_oss",
}
# multimodal model_type -> model_type of its text_config
MULTIMODAL_TEXT_TYPES: dict[str, str] = {
    "gemma3": "gemma3_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(set(DECODER_BLOCKS) | set(MULTIMODAL_TEXT_TYPES)))
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

_HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_MOE_TYPES = ("qwen3_next", "qwen3_5_moe_text")
_MAMBA_TYPES = ("granitemoehybrid", "bamba")
# Hugging Face layer type names of the Mamba2 hybrids (transformers 5 names and the legacy ones) -> layer kinds.
_MAMBA_LAYER_NAMES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "full_attention",
    "attention": "full_attention",
}
# The layer kinds a Hugging Face checkpoint of the non-Mamba families names in layer_types (Mamba2 hybrids name
# theirs differently, see _MAMBA_LAYER_NAMES).
_LAYER_TYPES = tuple(k for k in MIXER_RECIPES if k != "mamba")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# Defaults of the transformers 5.x config classes for the fields read here (used when config.json omits them).
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
}
# The Mamba2 fields' defaults, shared by the Granite 4.0 and Bamba configs.
_MAMBA2_DEFAULTS: dict[str, Any] = {
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rope_theta": 10000.0,
    },
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
    },
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
    },
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
    },
    "qwen3_5_text": {
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
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
    },
    "qwen3_5_moe_text": {
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
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
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 32768,
    },
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
        **_MAMBA2_DEFAULTS,
    },
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
        **_MAMBA2_DEFAULTS,
    },
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
    },
}


class _Fields:
  """Reads fields of one text config, falling back to the transformers defaults of its model type."""

  def __init__(self, text: Mapping[str, Any], model_type: str):
    self.text = text
    self.model_type = model_type
    self.defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[model_type]}

  def get(self, key: str) -> Any:
    """The value of `key` (None when neither the file nor the defaults set it, or the file sets null)."""
    if key in self.text:
      return self.text[key]
    return self.defaults.get(key)

  def require(self, key: str) -> Any:
    """The value of `key`; it must be set (by the file or the defaults) and not null."""
    value = self.get(key)
    if value is None:
      raise ValueError(f"Hugging Face config ({self.model_type}) must set {key!r}; it is missing or null")
    return value


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


def _text_config(hf_config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
  """Returns (text config dict, text model_type) of a text-only or multimodal config."""
  model_type = hf_config.get("model_type")
  if model_type in MULTIMODAL_TEXT_TYPES:
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError(f"Hugging Face config of multimodal model_type {model_type!r} must have a text_config object")
    text_type = text.get("model_type", MULTIMODAL_TEXT_TYPES[model_type])
    if text_type != MULTIMODAL_TEXT_TYPES[model_type]:
      raise NotImplementedError(
          f"text_config.model_type {text_type!r} of a {model_type!r} model is not supported "
          f"(expected {MULTIMODAL_TEXT_TYPES[model_type]!r})"
      )
    return text, text_type
  if model_type not in DECODER_BLOCKS:
    raise NotImplementedError(
        f"Hugging Face model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    )
  return hf_config, model_type


def _layer_types(fields: _Fields, num_layers: int) -> list[str]:
  """Per-layer kinds from `layer_types`, or derived as transformers derives them when absent."""
  model_type = fields.model_type
  if model_type in _MAMBA_TYPES:
    return _mamba_layer_types(fields, num_layers)
  given = fields.text.get("layer_types")
  if given is not None:
    if len(given) != num_layers or any(t not in _LAYER_TYPES for t in given):
      raise ValueError(
          f"Hugging Face config layer_types must list {num_layers} entries from {_LAYER_TYPES}, got {list(given)}"
      )
    return list(given)
  if model_type == "gemma3_text":
    pattern = int(fields.text.get("sliding_window_pattern", fields.text.get("_sliding_window_pattern", 6)))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
  if model_type == "gpt_oss":
    return ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(num_layers)]
  if model_type in _HYBRID_TYPES:
    interval = int(fields.get("full_attention_interval"))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
  if model_type == "qwen3" and fields.get("use_sliding_window") and fields.get("sliding_window") is not None:
    first_sliding = int(fields.get("max_window_layers"))
    return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
  return ["full_attention"] * num_layers


def _mamba_layer_types(fields: _Fields, num_layers: int) -> list[str]:
  """Granite 4.0: `layer_types` (or the legacy `layers_block_type`), every layer mamba when absent, as
  transformers does; Bamba: full attention at `attn_layer_indices`, mamba elsewhere."""
  if fields.model_type == "bamba":
    indices = fields.get("attn_layer_indices") or []
    if any(not 0 <= int(i) < num_layers for i in indices):
      raise ValueError(f"Hugging Face config attn_layer_indices must be layers in [0, {num_layers}), got {indices}")
    return ["full_attention" if i in {int(j) for j in indices} else "mamba" for i in range(num_layers)]
  given = fields.text.get("layer_types", fields.text.get("layers_block_type"))
  if given is None:
    return ["mamba"] * num_layers
  if len(given) != num_layers or any(t not in _MAMBA_LAYER_NAMES for t in given):
    raise ValueError(
        f"Hugging Face config layer_types of model_type {fields.model_type!r} must list {num_layers} entries from"
        f" {tuple(_MAMBA_LAYER_NAMES)}, got {list(given)}"
    )
  return [_MAMBA_LAYER_NAMES[t] for t in given]


def _json_float(value: Any, key: str) -> float:
  """A float of config.json; transformers writes non-finite ones as `{"__float__": "Infinity"}`."""
  if isinstance(value, Mapping) and set(value) == {"__float__"}:
    value = value["__float__"]
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f"Hugging Face config {key} must hold numbers, got {value!r}") from None


def _mamba_overrides(fields: _Fields, hidden: int) -> dict[str, Any]:
  """The `mamba_*` keys (Granite 4.0 and Bamba share the Mamba2 fields)."""
  heads = int(fields.require("mamba_n_heads"))
  head_dim = fields.require("mamba_d_head")
  if head_dim == "auto":
    inner = int(fields.require("mamba_expand")) * hidden
    if inner % heads:
      raise ValueError(f"Hugging Face config mamba_n_heads={heads} must divide mamba_expand * hidden_size = {inner}")
    head_dim = inner // heads
  if fields.require("hidden_act") not in ("silu", "swish"):
    raise NotImplementedError(
        f"hidden_act={fields.get('hidden_act')!r} of Hugging Face model_type {fields.model_type!r} is not supported"
        " (the Mamba2 conv activation is silu)"
    )
  limit = fields.get("time_step_limit") or (0.0, float("inf"))
  if not isinstance(limit, (list, tuple)) or len(limit) != 2:
    raise ValueError(f"Hugging Face config time_step_limit must be [min, max], got {limit!r}")
  lo, hi = _json_float(limit[0], "time_step_limit"), _json_float(limit[1], "time_step_limit")
  return {
      "mamba_num_heads": heads,
      "mamba_head_dim": int(head_dim),
      "mamba_state_dim": int(fields.require("mamba_d_state")),
      "mamba_num_groups": int(fields.require("mamba_n_groups")),
      "mamba_conv_kernel_dim": int(fields.require("mamba_d_conv")),
      "mamba_chunk_size": int(fields.require("mamba_chunk_size")),
      "mamba_conv_bias": bool(fields.get("mamba_conv_bias")),
      "mamba_proj_bias": bool(fields.get("mamba_proj_bias")),
      "mamba_time_step_min": max(lo, 0.0),
      "mamba_time_step_max": hi if hi != float("inf") else 0.0,
  }


def _granite_overrides(fields: _Fields) -> dict[str, Any]:
  """Granite 4.0's multipliers, optional RoPE and its MoE (softmax over the top-k logits, i.e. renormalised top-k
  probabilities) plus an ungated shared MLP; with no experts the shared MLP is the dense MLP."""
  experts = int(fields.get("num_local_experts") or 0)
  out: dict[str, Any] = {
      "embedding_multiplier": float(fields.require("embedding_multiplier")),
      "residual_multiplier": float(fields.require("residual_multiplier")),
      "attention_multiplier": float(fields.require("attention_multiplier")),
      "logits_scaling": float(fields.require("logits_scaling")),
      "use_rope": fields.get("position_embedding_type") == "rope",
      "num_experts": experts,
  }
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


def _cycle_interval(layer_types: list[str], other_kind: str) -> int:
  """Period N such that layer i is full attention iff (i + 1) % N == 0, or 1 when no such N exists."""
  full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
  if not full or any(t not in ("full_attention", other_kind) for t in layer_types):
    return 1
  n = full[0] + 1
  if all(((i + 1) % n == 0) == (t == "full_attention") for i, t in enumerate(layer_types)):
    return n
  return 1


def _scaling_overrides(scaling: Mapping[str, Any], where: str, fields: _Fields) -> dict[str, Any]:
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


def _rope_overrides(fields: _Fields) -> dict[str, Any]:
  """RoPE keys from `rope_parameters` (v5) or the legacy top-level fields."""
  text = fields.text
  params = text.get("rope_parameters")
  legacy_scaling = text.get("rope_scaling")
  if fields.model_type == "gemma3_text":
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


def _activation(fields: _Fields) -> str:
  # Gemma3 reads hidden_activation (its hidden_act field is unused by transformers); the others read hidden_act.
  key = "hidden_activation" if fields.model_type == "gemma3_text" else "hidden_act"
  act = fields.require(key)
  if act not in _ACTIVATIONS:
    raise NotImplementedError(
        f"activation {key}={act!r} of Hugging Face model_type {fields.model_type!r} is not supported "
        f"(supported: {', '.join(sorted(_ACTIVATIONS))})"
    )
  return _ACTIVATIONS[act]


def _gpt_oss_overrides(fields: _Fields, num_layers: int) -> dict[str, Any]:
  """gpt-oss: MoE on every layer (softmax over the top-k router logits), the clamped SwiGLU, full/sliding cycle."""
  out = {
      "num_experts": int(fields.require("num_local_experts")),
      "num_experts_per_tok": int(fields.require("num_experts_per_tok")),
      "base_moe_mlp_dim": int(fields.require("intermediate_size")),
      "norm_topk_prob": True,
      "swiglu_alpha": float(fields.require("swiglu_alpha")),
      "swiglu_limit": float(fields.require("swiglu_limit")),
  }
  layer_types = _layer_types(fields, num_layers)
  out["inhomogeneous_layer_cycle_interval"] = _cycle_interval(layer_types, "sliding_attention")
  return out


def hf_config_to_overrides(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """Maps a parsed Hugging Face config.json to overrides for `maxtext.configs.load_config(**overrides)`.

  Args:
    hf_config: the JSON object of config.json.

  Returns:
    A dict of base.yml keys (model shape, norms, RoPE, layer kinds, GDN and MoE fields).

  Raises:
    NotImplementedError: unsupported model_type, rope type, activation or feature.
    ValueError: a required field is missing or inconsistent.
  """
  text, model_type = _text_config(hf_config)
  fields = _Fields(text, model_type)
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
  if attention_bias and model_type in _HYBRID_TYPES:
    raise NotImplementedError(
        f"attention_bias=true of Hugging Face model_type {model_type!r} is not supported "
        "(the gated q_proj output gate has no bias)"
    )
  overrides: dict[str, Any] = {
      "decoder_block": DECODER_BLOCKS[model_type],
      "base_emb_dim": hidden,
      "base_num_decoder_layers": num_layers,
      "base_num_query_heads": num_heads,
      "base_num_kv_heads": int(num_kv_heads) if num_kv_heads is not None else num_heads,
      "head_dim": int(head_dim) if head_dim is not None else hidden // num_heads,
      "vocab_size": int(fields.require("vocab_size")),
      "mlp_activations": [_activation(fields), "linear"],
      "normalization_layer_epsilon": float(fields.require("rms_norm_eps")),
      "logits_via_embedding": bool(tie),
      "attention_bias": attention_bias,
      "mlp_bias": bool(fields.get("mlp_bias")) if model_type in ("llama", "bamba") else False,
  }
  if fields.get("intermediate_size") is not None:
    overrides["base_mlp_dim"] = int(fields.get("intermediate_size"))
  layer_types = _layer_types(fields, num_layers)
  overrides["layer_types"] = layer_types
  if "sliding_attention" in layer_types:
    overrides["sliding_window_size"] = int(fields.require("sliding_window"))
  if model_type == "gemma3_text":
    overrides["inhomogeneous_layer_cycle_interval"] = _cycle_interval(layer_types, "sliding_attention")
    overrides["query_pre_attn_scalar"] = float(fields.require("query_pre_attn_scalar"))
    overrides["final_logits_soft_cap"] = float(fields.get("final_logit_softcapping") or 0.0)
  overrides.update(_rope_overrides(fields))
  if model_type in _HYBRID_TYPES:
    overrides["inhomogeneous_layer_cycle_interval"] = _cycle_interval(layer_types, "linear_attention")
    overrides["gdn_num_key_heads"] = int(fields.require("linear_num_key_heads"))
    overrides["gdn_num_value_heads"] = int(fields.require("linear_num_value_heads"))
    overrides["gdn_key_head_dim"] = int(fields.require("linear_key_head_dim"))
    overrides["gdn_value_head_dim"] = int(fields.require("linear_value_head_dim"))
    overrides["gdn_conv_kernel_dim"] = int(fields.require("linear_conv_kernel_dim"))
  if model_type in _MAMBA_TYPES:
    overrides["inhomogeneous_layer_cycle_interval"] = _cycle_interval(layer_types, "mamba")
    overrides.update(_mamba_overrides(fields, hidden))
  if model_type == "granitemoehybrid":
    overrides.update(_granite_overrides(fields))
  if model_type == "gpt_oss":
    overrides.update(_gpt_oss_overrides(fields, num_layers))
  if model_type in _MOE_TYPES:
    overrides["num_experts"] = int(fields.require("num_experts"))
  if model_type in _MOE_TYPES and overrides["num_experts"] > 0:
    overrides["num_experts_per_tok"] = int(fields.require("num_experts_per_tok"))
    overrides["base_moe_mlp_dim"] = int(fields.require("moe_intermediate_size"))
    overrides["shared_expert_mlp_dim"] = int(fields.get("shared_expert_intermediate_size") or 0)
    # Qwen3.5-MoE has no such fields: every layer is MoE and top-k probabilities are always renormalised.
    overrides["norm_topk_prob"] = bool(fields.get("norm_topk_prob")) if model_type == "qwen3_next" else True
    overrides["decoder_sparse_step"] = int(fields.get("decoder_sparse_step") or 1)
    overrides["mlp_only_layers"] = [int(i) for i in (fields.get("mlp_only_layers") or [])]
  logger.debug("Hugging Face %s config -> overrides %s", model_type, overrides)
  return overrides
