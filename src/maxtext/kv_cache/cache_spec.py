"""What one layer's cache looks like, and the check that a runner slot holds exactly that.

Two kinds of cache, matching the runner's two allocators:
  - `AttentionSpec`: a paged KV cache in the runner's rank-5 layout `(num_blocks, block_size, packed heads, pk,
    padded head dim)` (see `kv_cache_layout`), addressed through a KV-cache group's block tables.
  - `RecurrentSpec`: a fixed-size state per request, held as a tuple of arrays with one row per state slot (slot 0 is
    the null slot) and addressed through `mamba_state_indices`. Gated DeltaNet keeps `(conv, recurrent)`; any other
    recurrent layer kind names its own arrays.
Layers declare their spec (`Mixer.cache_spec`); the runner side allocates from it and checks every slot against it
(`validate`) at trace time, before any kernel runs, so a wrong slot fails with the layer, the slot and what it
holds instead of a shape error deep inside a kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxtext.configs.layer_kinds import ATTENTION_CACHE, RECURRENT_CACHE
from maxtext.kv_cache.kv_cache_layout import get_kv_cache_shape

RECURRENT_STATE_DTYPE = "float32"  # recurrent states stay fp32 (a bf16 state is re-quantised every token)


def _itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def _dtype_name(dtype: Any) -> str:
  return jnp.dtype(dtype).name


def _where(slot: int | None) -> str:
  return f"kv_caches[{slot}]" if slot is not None else "its cache"


def kv_cache_dtype(cfg: Any) -> str:
  """The attention cache dtype: config key `kv_cache_dtype`, or the compute dtype `dtype` when it is `auto`."""
  return cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype


def describe_cache(cache: Any) -> str:
  """A short description of what a cache slot holds, for error messages (works on tracers)."""
  if isinstance(cache, (tuple, list)):
    if cache and all(hasattr(c, "shape") and hasattr(c, "dtype") for c in cache):
      arrays = ", ".join(f"{tuple(c.shape)} {_dtype_name(c.dtype)}" for c in cache)
      return f"a recurrent state ({arrays})"
    parts = ", ".join(describe_cache(c) for c in cache)
    return f"a {type(cache).__name__} of {len(cache)} ({parts})"
  if hasattr(cache, "shape") and hasattr(cache, "dtype"):
    return f"an array {tuple(cache.shape)} {_dtype_name(cache.dtype)}"
  return f"a {type(cache).__name__}"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """A paged attention cache: `(num_blocks, block_size, packed heads, pk, padded head dim)` per layer."""

  layer_type: str  # the layer kind, e.g. full_attention | sliding_attention
  block_size: int
  num_kv_heads: int  # already padded for tensor parallelism
  head_dim: int  # the real head dim (padding to 128 happens in the layout)
  dtype: str
  sliding_window: int | None  # None: the layer reads every earlier token
  # Tensor-parallel shards of the packed-head axis; each packs its own heads (`kv_cache_layout`).
  num_shards: int = 1

  cache_kind = ATTENTION_CACHE

  @property
  def kind(self) -> str:
    """The layer kind this cache serves."""
    return self.layer_type

  def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
    """The runner's cache shape for `num_blocks` blocks."""
    return get_kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.num_shards)

  def page_size_bytes(self) -> int:
    """Bytes of one block."""
    return int(np.prod(self.cache_shape(1))) * _itemsize(self.dtype)

  def describe(self) -> str:
    """One line for layout printouts."""
    window = f", window {self.sliding_window}" if self.sliding_window else ""
    return (
        f"{self.layer_type} (Hkv {self.num_kv_heads}, d {self.head_dim}, {self.dtype}, block {self.block_size}{window})"
    )

  def validate(self, name: str, cache: Any, slot: int | None = None) -> None:
    """Checks that `cache` is one array of this layout and dtype (any block count); works on tracers.

    Raises:
      ValueError: naming the layer, its kind, the slot and what the slot holds.
    """
    expected = self.cache_shape(1)[1:]
    ok = (
        hasattr(cache, "shape")
        and not isinstance(cache, (tuple, list))
        and len(cache.shape) == len(expected) + 1
        and tuple(cache.shape[1:]) == tuple(expected)
    )
    if not ok:
      raise ValueError(
          f"{name} is a {self.layer_type} layer and needs a paged KV cache (num_blocks,) + {tuple(expected)}"
          f" {self.dtype}, but {_where(slot)} holds {describe_cache(cache)}"
      )
    if _dtype_name(cache.dtype) != self.dtype:
      raise ValueError(
          f"{name} is a {self.layer_type} layer whose cache must be {self.dtype}, but {_where(slot)} holds"
          f" {describe_cache(cache)}"
      )


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
  """A per-request state held in a tuple of arrays, one row per state slot.

  Attributes:
    layer_type: the layer kind, e.g. linear_attention.
    state_names: a name per array, for messages (Gated DeltaNet: `("conv", "recurrent")`).
    state_shapes: the per-slot shape of each array (Gated DeltaNet: `(K-1, conv_dim)` and `(nv, dk, dv)`).
    state_dtypes: the dtype name of each array.
  """

  layer_type: str
  state_names: tuple[str, ...]
  state_shapes: tuple[tuple[int, ...], ...]
  state_dtypes: tuple[str, ...]

  cache_kind = RECURRENT_CACHE

  def __post_init__(self):
    n = len(self.state_names)
    if n == 0 or len(self.state_shapes) != n or len(self.state_dtypes) != n:
      raise ValueError(
          f"{self.layer_type}: a recurrent spec needs one name, shape and dtype per state array; got"
          f" {len(self.state_names)} names, {len(self.state_shapes)} shapes and {len(self.state_dtypes)} dtypes"
      )

  @property
  def kind(self) -> str:
    """The layer kind this cache serves."""
    return self.layer_type

  def cache_shapes(self, num_slots: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the arrays holding `num_slots` slots (slot 0 is the null slot)."""
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
      raise ValueError(f"num_slots must be an integer >= 1 (slot 0 is the null slot), got {num_slots!r}")
    return tuple((num_slots,) + tuple(shape) for shape in self.state_shapes)

  def slot_size_bytes(self) -> int:
    """Bytes of one slot over all arrays."""
    return sum(int(np.prod(s)) * _itemsize(d) for s, d in zip(self.state_shapes, self.state_dtypes))

  def _arrays(self) -> str:
    return ", ".join(f"{n} {tuple(s)} {d}" for n, s, d in zip(self.state_names, self.state_shapes, self.state_dtypes))

  def describe(self) -> str:
    """One line for layout printouts."""
    return f"{self.layer_type} ({self._arrays()})"

  def validate(self, name: str, cache: Any, slot: int | None = None) -> None:
    """Checks that `cache` is a tuple of this spec's arrays with equal slot counts; works on tracers.

    Raises:
      ValueError: naming the layer, its kind, the slot and what the slot holds.
    """
    n = len(self.state_shapes)
    ok = (
        isinstance(cache, (tuple, list))
        and len(cache) == n
        and all(hasattr(c, "shape") and hasattr(c, "dtype") for c in cache)
        and all(len(c.shape) == len(s) + 1 and tuple(c.shape[1:]) == tuple(s) for c, s in zip(cache, self.state_shapes))
        and len({c.shape[0] for c in cache}) == 1
    )
    needs = ", ".join(
        f"{n_} (slots,) + {tuple(s)} {d}" for n_, s, d in zip(self.state_names, self.state_shapes, self.state_dtypes)
    )
    if not ok:
      raise ValueError(
          f"{name} is a {self.layer_type} layer and needs a recurrent state ({needs}), but {_where(slot)} holds"
          f" {describe_cache(cache)}"
      )
    if any(_dtype_name(c.dtype) != d for c, d in zip(cache, self.state_dtypes)):
      raise ValueError(
          f"{name} is a {self.layer_type} layer whose state arrays must be {', '.join(self.state_dtypes)}"
          f" ({', '.join(self.state_names)}), but {_where(slot)} holds {describe_cache(cache)}"
      )


KVCacheSpec = AttentionSpec | RecurrentSpec
