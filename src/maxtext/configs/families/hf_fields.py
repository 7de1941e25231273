"""Reading a Hugging Face `config.json`, shared by the families' config mappings.

`HFFields` reads one text config with the transformers defaults of its model type as fallback; the helpers
derive layer patterns and read the field groups several families share (the Mamba2 fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from maxtext.configs.layer_kinds import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION

# Defaults of the transformers 5.x config classes for the fields every family reads.
COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
}
# The Mamba2 fields' defaults, shared by the Granite 4.0 and Bamba configs.
MAMBA2_DEFAULTS: dict[str, Any] = {
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
# The layer kinds a Hugging Face config's `layer_types` may name (the Mamba2 hybrids name theirs differently).
HF_LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)


class HFFields:
  """Reads fields of one text config, falling back to the transformers defaults of its model type.

  Args:
    text: the text config (config.json, or its `text_config` for a multimodal wrapper).
    model_type: the text model_type.
    defaults: the defaults of that model type's transformers config class.
  """

  def __init__(self, text: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any]):
    self.text = text
    self.model_type = model_type
    self.defaults = {**COMMON_DEFAULTS, **defaults}

  def get(self, key: str) -> Any:
    """The value of `key` (None when neither the file nor the defaults set it, or the file sets null)."""
    if key in self.text:
      return self.text[key]
    return self.defaults.get(key)

  def require(self, key: str) -> Any:
    """The value of `key`; it must be set (by the file or the defaults) and not null.

    Raises:
      ValueError: naming the model type and the field.
    """
    value = self.get(key)
    if value is None:
      raise ValueError(f"Hugging Face config ({self.model_type}) must set {key!r}; it is missing or null")
    return value


def given_layer_types(fields: HFFields, num_layers: int) -> list[str] | None:
  """The config's own `layer_types` (checked), or None when it has none.

  Raises:
    ValueError: a wrong length or a kind outside HF_LAYER_KINDS.
  """
  given = fields.text.get("layer_types")
  if given is None:
    return None
  if len(given) != num_layers or any(t not in HF_LAYER_KINDS for t in given):
    raise ValueError(
        f"Hugging Face config layer_types must list {num_layers} entries from {HF_LAYER_KINDS}, got {list(given)}"
    )
  return list(given)


def cycled(num_layers: int, interval: int, other_kind: str) -> list[str]:
  """Full attention at every `interval`-th layer, `other_kind` elsewhere."""
  return [FULL_ATTENTION if (i + 1) % interval == 0 else other_kind for i in range(num_layers)]


def cycle_interval(layer_types: list[str], other_kind: str) -> int:
  """Period N such that layer i is full attention iff (i + 1) % N == 0, or 1 when no such N exists."""
  full = [i for i, t in enumerate(layer_types) if t == FULL_ATTENTION]
  if not full or any(t not in (FULL_ATTENTION, other_kind) for t in layer_types):
    return 1
  n = full[0] + 1
  if all(((i + 1) % n == 0) == (t == FULL_ATTENTION) for i, t in enumerate(layer_types)):
    return n
  return 1


def json_float(value: Any, key: str) -> float:
  """A float of config.json; transformers writes non-finite ones as `{"__float__": "Infinity"}`.

  Raises:
    ValueError: not a number.
  """
  if isinstance(value, Mapping) and set(value) == {"__float__"}:
    value = value["__float__"]
  try:
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f"Hugging Face config {key} must hold numbers, got {value!r}") from None


def mamba2_overrides(fields: HFFields, hidden: int) -> dict[str, Any]:
  """The `mamba_*` keys of a Mamba2 hybrid (Granite 4.0 and Bamba share the Mamba2 fields).

  Raises:
    ValueError: inconsistent head counts or a malformed time_step_limit.
    NotImplementedError: an activation other than silu.
  """
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
  lo, hi = json_float(limit[0], "time_step_limit"), json_float(limit[1], "time_step_limit")
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
