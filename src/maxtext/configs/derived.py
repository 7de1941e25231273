"""Validation of key combinations and every derived value, computed in one place.

A key's own bound or choices are declared with it (`keys.py`); `validate` applies them, then the checks that
relate keys, in small named functions.

Derived values (added to the loaded config, `derive`): the per-layer kinds, KV-sharing sources and MoE flags, the
family's trait flags as `use_<trait>`, and the sizes computed from other keys; each is declared with its type and
description in `model_config.DERIVED`, as a field of the typed `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from maxtext.configs import families, layer_kinds
from maxtext.configs import keys as config_keys
from maxtext.configs.errors import ConfigError
from maxtext.configs.layer_kinds import FULL_ATTENTION

DECODER_BLOCKS = families.DECODER_BLOCKS
DTYPES = config_keys.DTYPES
QUANTIZATIONS = ("", "int8w")  # `quantization`: none, or int8 weight-only (the cpu kernel backend's int8 panels)
# Physical orders of the reference runner's cache list (see inference/kv_cache_manager.py).
KV_CACHE_LAYOUTS = config_keys.KEYS["kv_cache_layout"].choices
# The device mesh's axes and the keys that size them (see maxtext/models/sharding.py).
MESH_AXIS_KEYS = {"data": "ici_data_parallelism", "model": "ici_tensor_parallelism", "expert": "ici_expert_parallelism"}

# The registered families; every other key's choices and bounds are declared with the key (configs/keys.py).
_CHOICES: dict[str, tuple[str, ...]] = {"decoder_block": DECODER_BLOCKS}


def _fail(key: str, value: Any, must: str) -> ConfigError:
  return ConfigError(f"{key}={value!r}: {must}")


def default_layer_types(values: Mapping[str, Any]) -> tuple[str, ...]:
  """Per-layer kinds implied by the family when `layer_types` is not given: full attention every
  `inhomogeneous_layer_cycle_interval` layers and the family's cycle kind between (full attention everywhere for a
  family without one)."""
  other = families.get_family(values["decoder_block"]).cycle_kind
  n = values["base_num_decoder_layers"]
  if other is None:
    return (FULL_ATTENTION,) * n
  interval = values["inhomogeneous_layer_cycle_interval"]
  return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else other for i in range(n))


def kv_shared_sources(layer_types: tuple[str, ...], num_kv_shared_layers: int) -> tuple[int, ...]:
  """Source layer of every KV-shared layer (-1 for layers that compute their own K/V).

  The last `num_kv_shared_layers` layers reuse the K/V of the last earlier non-shared layer of the same type.

  Raises:
    ConfigError: a shared layer is not an attention layer or has no earlier non-shared layer of its type.
  """
  n = len(layer_types)
  first_shared = n - num_kv_shared_layers
  sources = [-1] * n
  for i in range(first_shared, n):
    kind = layer_types[i]
    if not layer_kinds.is_attention_kind(kind):
      raise _fail("num_kv_shared_layers", num_kv_shared_layers, f"layer {i} is {kind}; only attention layers share K/V")
    candidates = [j for j in range(first_shared) if layer_types[j] == kind]
    if not candidates:
      raise _fail(
          "num_kv_shared_layers",
          num_kv_shared_layers,
          f"KV-shared layer {i} ({kind}) needs an earlier non-shared {kind} layer, and layers 0..{first_shared - 1}"
          " have none",
      )
    sources[i] = candidates[-1]
  return tuple(sources)


def validate(values: Mapping[str, Any]) -> None:
  """Checks every key's range and every combination of keys.

  Raises:
    ConfigError: naming the key, the value given and what must hold.
  """
  _check_single_keys(values)
  _check_heads(values)
  _check_mlp_and_rope(values)
  _check_layers(values)
  _check_runner(values)


def _check_single_keys(values: Mapping[str, Any]) -> None:
  """Each key alone: finite numbers, declared choices and bounds, quantization."""
  for key, value in values.items():
    if isinstance(value, float) and not math.isfinite(value):  # NaN would pass every `<` check below
      raise _fail(key, value, "must be a finite number")
  for key, choices in _CHOICES.items():
    if values[key] not in choices:
      raise _fail(key, values[key], f"must be one of {', '.join(choices)}")
  config_keys.check_choices(values)
  if values["quantization"] not in QUANTIZATIONS:
    raise _fail(
        "quantization", values["quantization"], "must be '' (weights in weight_dtype) or 'int8w' (int8 weight-only)"
    )
  if values["quantization"] and values["weight_dtype"] != "bfloat16":
    raise ConfigError(
        f"quantization={values['quantization']!r} keeps the weights it does not quantize (the embedding table, the"
        f" norms, kernels whose sizes are not multiples of 32) in weight_dtype, which must then be bfloat16; got"
        f" weight_dtype={values['weight_dtype']!r}"
    )
  config_keys.check_bounds(values, config_keys.POSITIVE)
  if values["greedy_head_candidates"] > values["vocab_size"]:
    raise _fail(
        "greedy_head_candidates",
        values["greedy_head_candidates"],
        f"must be at most vocab_size ({values['vocab_size']}): the candidates are tokens of the vocabulary",
    )
  config_keys.check_bounds(values, config_keys.NON_NEGATIVE)
  if values["max_new_tokens"] < 0:
    raise _fail("max_new_tokens", values["max_new_tokens"], "must be >= 0 (0 = until eos, within max_target_length)")


def _check_heads(values: Mapping[str, Any]) -> None:
  """Head counts that must divide each other, the Mamba2 conv and time step."""
  hq, hkv = values["base_num_query_heads"], values["base_num_kv_heads"]
  if hq % hkv:
    raise _fail("base_num_query_heads", hq, f"must be divisible by base_num_kv_heads={hkv}")
  nk, nv = values["gdn_num_key_heads"], values["gdn_num_value_heads"]
  if nv % nk:
    raise _fail("gdn_num_value_heads", nv, f"must be divisible by gdn_num_key_heads={nk}")
  mh, mg = values["mamba_num_heads"], values["mamba_num_groups"]
  if mh % mg:
    raise _fail("mamba_num_heads", mh, f"must be divisible by mamba_num_groups={mg}")
  if values["mamba_conv_kernel_dim"] < 2:
    raise _fail(
        "mamba_conv_kernel_dim", values["mamba_conv_kernel_dim"], "must be >= 2 (the conv state keeps K - 1 rows)"
    )
  dt_min, dt_max = values["mamba_time_step_min"], values["mamba_time_step_max"]
  if 0 < dt_max < dt_min:
    raise _fail("mamba_time_step_max", dt_max, f"must be 0 (no limit) or >= mamba_time_step_min={dt_min}")


def _check_mlp_and_rope(values: Mapping[str, Any]) -> None:
  """The gated MLP activations and the rotary embedding keys."""
  acts = values["mlp_activations"]
  if len(acts) != 2 or acts[0] not in ("silu", "gelu_tanh") or acts[1] != "linear":
    raise _fail("mlp_activations", list(acts), 'must be ["silu" or "gelu_tanh", "linear"] (a gated MLP)')

  factor = values["partial_rotary_factor"]
  if not 0.0 < factor <= 1.0:
    raise _fail("partial_rotary_factor", factor, "must be in (0, 1]")
  rotary_dim = int(values["head_dim"] * factor)
  if rotary_dim < 2 or rotary_dim % 2:
    raise _fail("partial_rotary_factor", factor, f"head_dim * factor = {rotary_dim} must be an even number >= 2")
  if values["rope_scaling_factor"] <= 0:
    raise _fail("rope_scaling_factor", values["rope_scaling_factor"], "must be > 0")
  for key in ("rope_max_timescale", "local_rope_max_timescale"):
    if values[key] <= 0:
      raise _fail(key, values[key], "must be > 0")
  if values["rope_type"] == "llama3" and values["rope_high_freq_factor"] <= values["rope_low_freq_factor"]:
    raise _fail(
        "rope_high_freq_factor",
        values["rope_high_freq_factor"],
        f"must be > rope_low_freq_factor={values['rope_low_freq_factor']} for rope_type=llama3",
    )

  if values["rope_type"] == "yarn" and not values["rope_beta_fast"] > values["rope_beta_slow"] > 0:
    raise _fail(
        "rope_beta_fast",
        values["rope_beta_fast"],
        f"must be > rope_beta_slow={values['rope_beta_slow']} > 0 for rope_type=yarn",
    )
  if values["rope_attention_factor"] < 0:
    raise _fail("rope_attention_factor", values["rope_attention_factor"], "must be >= 0 (0 = derived from the factor)")


def _check_layers(values: Mapping[str, Any]) -> None:
  """The family's and every layer kind's checks, the per-layer lists."""
  family = families.get_family(values["decoder_block"])
  if family.check is not None:
    family.check(values)

  n = values["base_num_decoder_layers"]
  layer_types = values["layer_types"] or default_layer_types(values)
  if len(layer_types) != n:
    raise _fail("layer_types", list(layer_types), f"must have one entry per layer (base_num_decoder_layers={n})")
  names = layer_kinds.layer_kind_names()
  for i, kind in enumerate(layer_types):
    declared = layer_kinds.get_layer_kind(kind)
    if declared is None:
      raise _fail("layer_types", list(layer_types), f"entry {i} ({kind!r}) must be one of {', '.join(names)}")
    if declared.check is not None:
      declared.check(values, i)
    owners = families.kind_owners(kind)
    if owners and family.name not in owners:
      raise _fail(
          "layer_types",
          list(values["layer_types"]),
          f"layer {i} is {kind}, which needs decoder_block in {', '.join(owners)} (got {family.name!r})",
      )
  if values["num_kv_shared_layers"] >= n:
    raise _fail("num_kv_shared_layers", values["num_kv_shared_layers"], f"must be < base_num_decoder_layers={n}")
  kv_shared_sources(tuple(layer_types), values["num_kv_shared_layers"])

  experts = values["num_experts"]
  if experts > 0:
    if values["num_experts_per_tok"] > experts:
      raise _fail("num_experts_per_tok", values["num_experts_per_tok"], f"must be <= num_experts={experts}")
    if values["base_moe_mlp_dim"] <= 0:
      raise _fail("base_moe_mlp_dim", values["base_moe_mlp_dim"], f"must be > 0 when num_experts={experts}")
  for layer in values["mlp_only_layers"]:
    if not 0 <= layer < n:
      raise _fail("mlp_only_layers", list(values["mlp_only_layers"]), f"layer {layer} must be in [0, {n})")


def _check_runner(values: Mapping[str, Any]) -> None:
  """The prompt tokens, the scheduler and cache sizes, the mesh rules."""
  vocab = values["vocab_size"]
  for token in values["prompt_token_ids"]:
    if not 0 <= token < vocab:
      raise _fail(
          "prompt_token_ids", list(values["prompt_token_ids"]), f"token {token} must be in [0, vocab_size={vocab})"
      )
  if values["max_num_batched_tokens"] < values["max_num_seqs"]:
    raise _fail(
        "max_num_batched_tokens",
        values["max_num_batched_tokens"],
        f"must be >= max_num_seqs={values['max_num_seqs']} (every scheduled request needs a token)",
    )
  mamba_block_size, block_size = values["mamba_block_size"], values["block_size"]
  if mamba_block_size < 0 or mamba_block_size % block_size:
    raise _fail(
        "mamba_block_size",
        mamba_block_size,
        f"must be 0 (= block_size) or a positive multiple of block_size={block_size} (a recurrent state block ends"
        " where an attention block ends)",
    )
  bucket = values["min_token_bucket"]
  if bucket & (bucket - 1):
    raise _fail("min_token_bucket", bucket, "must be a power of two (token buckets are powers of two)")
  _validate_axis_rules(values["logical_axis_rules"])
  if values["decode_sampling_nucleus_p"] > 1.0:
    raise _fail("decode_sampling_nucleus_p", values["decode_sampling_nucleus_p"], "must be <= 1")
  if values["decode_sampling_temperature"] > 2.0:  # vLLM's bound, which SamplingParams applies
    raise _fail("decode_sampling_temperature", values["decode_sampling_temperature"], "must be <= 2")


def _validate_axis_rules(rules: Any) -> None:
  seen = set()
  for entry in rules:
    shown = list(entry) if isinstance(entry, tuple) else entry
    if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str):
      raise _fail("logical_axis_rules", shown, "each entry must be [logical axis, mesh axis | [mesh axes] | null]")
    target = entry[1]
    axes = () if target is None else (target,) if isinstance(target, str) else target
    if not isinstance(axes, tuple) or any(a not in MESH_AXIS_KEYS for a in axes):
      raise _fail("logical_axis_rules", shown, f"mesh axes must be among {', '.join(MESH_AXIS_KEYS)} (or null)")
    if entry[0] in seen:
      raise _fail("logical_axis_rules", shown, f"logical axis {entry[0]!r} has two rules; give one")
    seen.add(entry[0])


def state_block_size(cfg: Any) -> int:
  """Tokens per recurrent state block under prefix caching: `mamba_block_size`, or `block_size` when it is 0."""
  return int(cfg.mamba_block_size) or int(cfg.block_size)


def derive(values: Mapping[str, Any]) -> dict[str, Any]:
  """Returns every derived value of a validated configuration (see the module docstring)."""
  n = values["base_num_decoder_layers"]
  traits = families.get_family(values["decoder_block"]).traits
  layer_types = tuple(values["layer_types"]) or default_layer_types(values)
  experts = values["num_experts"]
  only_dense = set(values["mlp_only_layers"])
  moe_layers = tuple(
      experts > 0 and i not in only_dense and (i + 1) % values["decoder_sparse_step"] == 0 for i in range(n)
  )
  scalar = values["query_pre_attn_scalar"]
  nk, nv = values["gdn_num_key_heads"], values["gdn_num_value_heads"]
  mamba_inner = values["mamba_num_heads"] * values["mamba_head_dim"]
  return {
      "layer_types": layer_types,
      "kv_shared_source": kv_shared_sources(layer_types, values["num_kv_shared_layers"]),
      "moe_layers": moe_layers,
      **{f"use_{name}": value for name, value in dataclasses.asdict(traits).items()},
      "rotary_dim": int(values["head_dim"] * values["partial_rotary_factor"]),
      "attention_scale": (
          values["attention_multiplier"]
          if values["attention_multiplier"] > 0
          else (scalar if scalar > 0 else values["head_dim"]) ** -0.5
      ),
      "gdn_conv_dim": 2 * nk * values["gdn_key_head_dim"] + nv * values["gdn_value_head_dim"],
      "mamba_inner_dim": mamba_inner,
      "mamba_conv_dim": mamba_inner + 2 * values["mamba_num_groups"] * values["mamba_state_dim"],
      "state_block_size": int(values["mamba_block_size"]) or int(values["block_size"]),
  }
