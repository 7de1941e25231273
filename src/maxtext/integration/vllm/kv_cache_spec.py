"""What caches the model asks the runner for, per layer, and the check that a slot holds what a layer needs.

Attention layers ask for a paged KV cache in the runner's rank-5 layout (contract.md section 2); Gated DeltaNet
layers ask for a recurrent state pair `(conv_state, recurrent_state)` addressed by state slots. KV-sharing layers ask
for nothing: they read their source layer's cache, and the runner maps their name to the source's slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from maxtext.configs.derived import ATTENTION_LAYER_TYPES, LINEAR_ATTENTION, SLIDING_ATTENTION
from maxtext.integration.vllm.hybrid_cache_utils import layer_name
from maxtext.kernels.kv_cache_layout import get_kv_cache_shape, get_padded_num_heads

RECURRENT_STATE_DTYPE = "float32"  # the recurrent state is kept in fp32 (bf16 loses it token by token upstream)


def _itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """A paged attention cache: `(num_blocks, block_size, packed heads, pk, padded head dim)` per layer."""

  layer_type: str  # full_attention | sliding_attention
  block_size: int
  num_kv_heads: int  # already padded for tensor parallelism
  head_dim: int  # the real head dim (padding to 128 happens in the layout)
  dtype: str
  sliding_window: int | None  # None for full attention

  @property
  def kind(self) -> str:
    """The layer kind this cache serves."""
    return self.layer_type

  def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
    """The runner's cache shape for `num_blocks` blocks."""
    return get_kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

  def page_size_bytes(self) -> int:
    """Bytes of one block."""
    return int(np.prod(self.cache_shape(1))) * _itemsize(self.dtype)

  def describe(self) -> str:
    """One line for layout printouts."""
    window = f", window {self.sliding_window}" if self.sliding_window else ""
    return (
        f"{self.layer_type} (Hkv {self.num_kv_heads}, d {self.head_dim}, {self.dtype}, block {self.block_size}{window})"
    )


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
  """A Gated DeltaNet state pair per slot: conv `(K-1, conv_dim)` and recurrent `(nv, dk, dv)` in fp32."""

  conv_shape: tuple[int, int]
  recurrent_shape: tuple[int, int, int]
  conv_dtype: str
  recurrent_dtype: str = RECURRENT_STATE_DTYPE

  @property
  def kind(self) -> str:
    """The layer kind this cache serves."""
    return LINEAR_ATTENTION

  def cache_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the (conv, recurrent) arrays holding `num_slots` slots (slot 0 is the null slot)."""
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
      raise ValueError(f"num_slots must be an integer >= 1 (slot 0 is the null slot), got {num_slots!r}")
    return (num_slots,) + tuple(self.conv_shape), (num_slots,) + tuple(self.recurrent_shape)

  def slot_size_bytes(self) -> int:
    """Bytes of one slot (conv + recurrent state)."""
    conv = int(np.prod(self.conv_shape)) * _itemsize(self.conv_dtype)
    return conv + int(np.prod(self.recurrent_shape)) * _itemsize(self.recurrent_dtype)

  def describe(self) -> str:
    """One line for layout printouts."""
    return (
        f"linear_attention (conv {tuple(self.conv_shape)} {self.conv_dtype},"
        f" recurrent {tuple(self.recurrent_shape)} {self.recurrent_dtype})"
    )


KVCacheSpec = AttentionSpec | RecurrentSpec


def kv_cache_dtype(cfg: ml_collections.FrozenConfigDict) -> str:
  """The attention cache dtype: `kv_cache_dtype`, or the compute dtype when it is `auto`."""
  return cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype


def get_layer_spec(cfg: ml_collections.FrozenConfigDict, layer: int) -> KVCacheSpec:
  """The cache spec of layer `layer` (for a KV-shared layer: the spec of the cache it reads)."""
  kind = cfg.layer_types[layer]
  if kind == LINEAR_ATTENTION:
    return RecurrentSpec(
        conv_shape=(cfg.gdn_conv_kernel_dim - 1, cfg.gdn_conv_dim),
        recurrent_shape=(cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim),
        conv_dtype=cfg.dtype,
    )
  assert kind in ATTENTION_LAYER_TYPES, kind
  return AttentionSpec(
      layer_type=kind,
      block_size=cfg.block_size,
      num_kv_heads=get_padded_num_heads(cfg.base_num_kv_heads, cfg.ici_tensor_parallelism),
      head_dim=cfg.head_dim,
      dtype=kv_cache_dtype(cfg),
      sliding_window=cfg.sliding_window_size if kind == SLIDING_ATTENTION else None,
  )


def get_kv_cache_specs(cfg: ml_collections.FrozenConfigDict) -> dict[str, KVCacheSpec]:
  """The cache every layer that owns one asks for: `{"layer.<i>": spec}`; KV-shared layers are absent."""
  return {
      layer_name(i): get_layer_spec(cfg, i) for i in range(cfg.base_num_decoder_layers) if cfg.kv_shared_source[i] < 0
  }


def get_shared_kv_cache_layers(cfg: ml_collections.FrozenConfigDict) -> dict[str, str]:
  """KV-sharing layers and the layer whose cache each reads: `{"layer.<i>": "layer.<source>"}`."""
  return {layer_name(i): layer_name(src) for i, src in enumerate(cfg.kv_shared_source) if src >= 0}


def describe_cache(cache: Any) -> str:
  """A short description of what a cache slot holds, for error messages (works on tracers)."""
  if isinstance(cache, (tuple, list)):
    parts = ", ".join(describe_cache(c) for c in cache)
    if len(cache) == 2 and all(hasattr(c, "shape") for c in cache):
      conv, rec = cache
      return f"a recurrent state (conv {tuple(conv.shape)} {conv.dtype}, recurrent {tuple(rec.shape)} {rec.dtype})"
    return f"a {type(cache).__name__} of {len(cache)} ({parts})"
  if hasattr(cache, "shape") and hasattr(cache, "dtype"):
    return f"an array {tuple(cache.shape)} {cache.dtype}"
  return f"a {type(cache).__name__}"


def _dtype_name(dtype: Any) -> str:
  return jnp.dtype(dtype).name


def validate_layer_cache(name: str, spec: KVCacheSpec, cache: Any, slot: int | None = None) -> None:
  """Checks that a cache slot holds what a layer's spec asks for (rank, shape, dtype, array vs tuple).

  Works on traced values (only shapes and dtypes are read), so it runs at trace time, before any kernel.

  Args:
    name: the layer name, e.g. "layer.3".
    spec: the layer's spec (for a KV-shared layer, its source's spec).
    cache: what the runner's slot holds.
    slot: the physical slot index, for the message.

  Raises:
    ValueError: naming the layer, its kind, the slot and what the slot holds.
  """
  where = f"kv_caches[{slot}]" if slot is not None else "its cache"
  holds = describe_cache(cache)
  if isinstance(spec, AttentionSpec):
    expected = spec.cache_shape(1)[1:]
    ok = (
        hasattr(cache, "shape")
        and not isinstance(cache, (tuple, list))
        and len(cache.shape) == len(expected) + 1
        and tuple(cache.shape[1:]) == tuple(expected)
    )
    if not ok:
      raise ValueError(
          f"{name} is a {spec.layer_type} layer and needs a paged KV cache (num_blocks,) + {tuple(expected)}"
          f" {spec.dtype}, but {where} holds {holds}"
      )
    if _dtype_name(cache.dtype) != spec.dtype:
      raise ValueError(f"{name} is a {spec.layer_type} layer whose cache must be {spec.dtype}, but {where} holds {holds}")
    return
  conv_shape, rec_shape = spec.cache_shapes(1)
  ok = (
      isinstance(cache, (tuple, list))
      and len(cache) == 2
      and all(hasattr(c, "shape") for c in cache)
      and tuple(cache[0].shape[1:]) == conv_shape[1:]
      and tuple(cache[1].shape[1:]) == rec_shape[1:]
      and cache[0].shape[0] == cache[1].shape[0]
  )
  if not ok:
    raise ValueError(
        f"{name} is a linear_attention layer and needs a recurrent state (conv (slots,) + {conv_shape[1:]}"
        f" {spec.conv_dtype}, recurrent (slots,) + {rec_shape[1:]} {spec.recurrent_dtype}), but {where} holds {holds}"
    )
  if _dtype_name(cache[0].dtype) != spec.conv_dtype or _dtype_name(cache[1].dtype) != spec.recurrent_dtype:
    raise ValueError(
        f"{name} is a linear_attention layer whose conv state must be {spec.conv_dtype} and recurrent state"
        f" {spec.recurrent_dtype}, but {where} holds {holds}"
    )


def validate_layer_caches(
    cfg: ml_collections.FrozenConfigDict, layer_caches: list, layer_indices: tuple[int, ...] | None = None
) -> None:
  """Checks every layer's cache (layer order) against its spec; see `validate_layer_cache`."""
  specs: Mapping[int, KVCacheSpec] = {i: get_layer_spec(cfg, i) for i in range(cfg.base_num_decoder_layers)}
  if len(layer_caches) != len(specs):
    raise ValueError(f"expected one cache per layer ({len(specs)} layers), got {len(layer_caches)}")
  for i, cache in enumerate(layer_caches):
    validate_layer_cache(layer_name(i), specs[i], cache, None if layer_indices is None else layer_indices[i])
