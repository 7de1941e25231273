"""`ModelConfig`: the model's config as one frozen, typed dataclass, which the layers and the decoder read.

Its fields are the `MODEL` keys of `keys.py` (each declared there once, with its type, bound or choices and
description) and the values `derived.derive` computes from them (declared here, `DERIVED`). A loaded config (YAML +
`key=value`, validated by `loader` and `derived`) becomes one with `ModelConfig.from_config`; the run's other keys
(the caches', the scheduler's, the CLI's, the runner's) are not fields, so a layer cannot read them. Lists become
tuples: the config is immutable and hashable, as a jitted function's static argument must be.

    cfg = ModelConfig.from_config(load_config(model_name="qwen3-tiny"))
    cfg.base_emb_dim, cfg.layer_types, cfg.use_qk_norm   # 64, ("full_attention", ...), True
    ModelConfig.describe("sliding_window_size")          # the key's one-line description
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from maxtext.configs import keys as config_keys
from maxtext.configs.keys import MODEL, RUNTIME, Key

# The derived values of a loaded config that the model reads (computed by `derived.derive`).
DERIVED = (
    Key("kv_shared_source", tuple, MODEL, "per layer: -1, or the layer whose K/V a KV-shared layer reuses", element=int),
    Key("moe_layers", tuple, MODEL, "per layer: whether the MLP is a mixture of experts", element=bool),
    Key("use_qk_norm", bool, MODEL, "trait: RMSNorm on every query and key head"),
    Key("use_zero_centered_norm", bool, MODEL, "trait: norms scale by 1 + weight"),
    Key("use_sandwich_norm", bool, MODEL, "trait: norms after attention and MLP as well as before"),
    Key("use_embedding_scale", bool, MODEL, "trait: embeddings scaled by sqrt(emb_dim)"),
    Key("use_attention_output_gate", bool, MODEL, "trait: a sigmoid gate on the attention output"),
    Key("use_attention_sinks", bool, MODEL, "trait: a learned sink logit per head"),
    Key("use_moe_bias", bool, MODEL, "trait: biases on the router and the experts"),
    Key("use_clamped_swiglu", bool, MODEL, "trait: gpt-oss's clamped SwiGLU"),
    Key("use_global_rope_on_sliding", bool, MODEL, "trait: sliding layers use the global RoPE settings"),
    Key("rotary_dim", int, MODEL, "rotated channels per head: head_dim * partial_rotary_factor"),
    Key("attention_scale", float, MODEL, "query scale (attention_multiplier, else query_pre_attn_scalar**-0.5)"),
    Key("gdn_conv_dim", int, MODEL, "Gated DeltaNet conv channels: 2 * key heads * key dim + value heads * value dim"),
    Key("mamba_inner_dim", int, MODEL, "Mamba2 inner size: heads * head dim"),
    Key("mamba_conv_dim", int, MODEL, "Mamba2 conv channels [x | B | C]: inner + 2 * groups * state dim"),
    # Computed from the runner's cache keys (`RUNTIME`): it shapes the paged path, never a parameter.
    Key("state_block_size", int, RUNTIME, "tokens per recurrent state block under prefix caching (the runner's)"),
)
FIELDS: tuple[Key, ...] = tuple(k for k in config_keys.KEYS.values() if k.category == MODEL) + DERIVED
# The derived values that never change a parameter array (left out of the weight cache's key, as RUNTIME keys are).
DERIVED_RUNTIME_KEYS = frozenset(k.name for k in DERIVED if k.category == RUNTIME)


def _annotation(key: Key) -> Any:
  if key.type in (list, tuple):
    return tuple[key.element if key.element is not list else tuple, ...] if key.element else tuple
  return key.type


def _frozen(value: Any) -> Any:
  """Lists (and ml_collections' tuples of lists) as nested tuples."""
  if isinstance(value, (list, tuple)):
    return tuple(_frozen(v) for v in value)
  return value


def _check_type(key: Key, value: Any) -> None:
  want = tuple if key.type in (list, tuple) else key.type
  ok = isinstance(value, want) and not (want in (int, float) and isinstance(value, bool))
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    ok = True
  if not ok:
    raise TypeError(f"ModelConfig.{key.name} must be {want.__name__} ({key.description}), got {value!r}")


def _from_config(cls: type, cfg: Mapping[str, Any]) -> Any:
  """The model's config of a loaded config: its `MODEL` keys and derived values, lists as tuples.

  Raises:
    KeyError: `cfg` lacks a field (it was not loaded by `load_config` / `load_run_config`).
    TypeError: a value is not of its key's declared type.
  """
  if isinstance(cfg, cls):
    return cfg
  values = {}
  for key in FIELDS:
    if key.name not in cfg:
      raise KeyError(f"ModelConfig needs {key.name!r} ({key.description}); build the config with load_config")
    value = _frozen(cfg[key.name])
    _check_type(key, value)
    values[key.name] = float(value) if key.type is float else value
  return cls(**values)


def _describe(name: str) -> str:
  """The one-line description of field `name`."""
  return _BY_NAME[name].description


def _item(self: Any, name: str) -> Any:
  """`cfg[name]`: the field `name`."""
  return getattr(self, name)


def _get(self: Any, name: str, default: Any = None) -> Any:
  """`cfg.get(name, default)`: the field `name`, or `default` when there is none."""
  return getattr(self, name, default)


_BY_NAME = {k.name: k for k in FIELDS}
# Each field carries its declaration (`dataclasses.fields(ModelConfig)[i].metadata["key"]`).
_FIELD_SPECS = [
    (k.name, _annotation(k), dataclasses.field(metadata={"key": k})) for k in FIELDS  # pylint: disable=invalid-field-call
]

ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    _FIELD_SPECS,
    frozen=True,
    namespace={
        "__doc__": (
            "The model's config: every MODEL key of configs/keys.py and the derived values of DERIVED, typed and"
            " frozen. Build it with `ModelConfig.from_config(loaded_config)`; `describe(name)` gives a field's"
            " description."
        ),
        "__module__": __name__,
        "from_config": classmethod(_from_config),
        "describe": staticmethod(_describe),
        # Attribute access is the layers' interface; the config is also read like the mapping it replaces.
        "__getitem__": _item,
        "get": _get,
    },
)


@functools.cache
def field_names() -> frozenset[str]:
  """The names of `ModelConfig`'s fields."""
  return frozenset(_BY_NAME)
