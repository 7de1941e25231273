"""What caches the model asks the runner for, per layer, and the check that a slot holds what a layer needs.

Each layer's mixer declares its cache (`Mixer.cache_spec`): attention layers a paged KV cache in the runner's
rank-5 layout, recurrent layers (Gated DeltaNet, ...) a state tuple addressed by state slots. KV-sharing layers ask
for nothing: they read their source layer's cache, and the runner maps their name to the source's slot. The spec
classes live in `maxtext.kv_cache.cache_spec`; this module is the runner-facing view of a whole config.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from maxtext.kv_cache.hybrid_cache_utils import layer_name
from maxtext.kv_cache.cache_spec import (
    RECURRENT_STATE_DTYPE,
    AttentionSpec,
    KVCacheSpec,
    RecurrentSpec,
    describe_cache,
    kv_cache_dtype,
)
from maxtext.layers.mixer import layer_mixer_class

__all__ = [
    "RECURRENT_STATE_DTYPE",
    "AttentionSpec",
    "KVCacheSpec",
    "RecurrentSpec",
    "describe_cache",
    "get_kv_cache_specs",
    "get_layer_spec",
    "get_shared_kv_cache_layers",
    "kv_cache_dtype",
    "validate_layer_cache",
    "validate_layer_caches",
]


def get_layer_spec(cfg: ml_collections.FrozenConfigDict, layer: int) -> KVCacheSpec:
  """The cache spec of layer `layer` (for a KV-shared layer: the spec of the cache it reads)."""
  return layer_mixer_class(cfg, layer).cache_spec(cfg, layer)


def get_kv_cache_specs(cfg: ml_collections.FrozenConfigDict) -> dict[str, KVCacheSpec]:
  """The cache every layer that owns one asks for: `{"layer.<i>": spec}`; KV-shared layers are absent."""
  return {
      layer_name(i): get_layer_spec(cfg, i) for i in range(cfg.base_num_decoder_layers) if cfg.kv_shared_source[i] < 0
  }


def get_shared_kv_cache_layers(cfg: ml_collections.FrozenConfigDict) -> dict[str, str]:
  """KV-sharing layers and the layer whose cache each reads: `{"layer.<i>": "layer.<source>"}`."""
  return {layer_name(i): layer_name(src) for i, src in enumerate(cfg.kv_shared_source) if src >= 0}


def validate_layer_cache(name: str, spec: KVCacheSpec, cache: Any, slot: int | None = None) -> None:
  """Checks that a cache slot holds what a layer's spec asks for (see the spec's `validate`).

  Args:
    name: the layer name, e.g. "layer.3".
    spec: the layer's spec (for a KV-shared layer, its source's spec).
    cache: what the runner's slot holds.
    slot: the physical slot index, for the message.

  Raises:
    ValueError: naming the layer, its kind, the slot and what the slot holds.
  """
  spec.validate(name, cache, slot)


def validate_layer_caches(
    cfg: ml_collections.FrozenConfigDict, layer_caches: list, layer_indices: tuple[int, ...] | None = None
) -> None:
  """Checks every layer's cache (layer order) against its spec; works at trace time, before any kernel."""
  n = cfg.base_num_decoder_layers
  if len(layer_caches) != n:
    raise ValueError(f"expected one cache per layer ({n} layers), got {len(layer_caches)}")
  for i, cache in enumerate(layer_caches):
    get_layer_spec(cfg, i).validate(layer_name(i), cache, None if layer_indices is None else layer_indices[i])
