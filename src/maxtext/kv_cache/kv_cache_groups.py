"""The KV-cache groups and the physical arrays of the reference runner, formed by the rules vLLM and tpu-inference use.

Groups (which layers share one block table), from the specs of the layers that own a cache, in layer order:
  1. Layers are bucketed by equal spec, buckets in order of first occurrence. With `hybrid_kv_cache=True` every
     distinct spec is a bucket (full attention, each sliding window, each recurrent spec); with
     `hybrid_kv_cache=False` every attention layer falls in one bucket (its single group keeps every block).
  2. With `hybrid_kv_cache=True` and more than one bucket every bucket is split into groups of one size: the
     smallest bucket's layer count, or the largest's when the largest is below 1.5 times the smallest (fewer
     padding layers). A bucket of `n`
     layers gives `g = cdiv(n, size)` groups, group `i` taking every g-th layer from the i-th: `layers[i::g]`.
     A 5:1 sliding:full model of 12 layers so gets 6 groups of 2 layers (5 sliding, then 1 full).
  Groups are numbered bucket after bucket. Otherwise every bucket is one group.

Physical arrays (which layers share one array), as tpu-inference 0.32.0 keys its cache slots:
  - A model with recurrent layers, or with `hybrid_kv_cache=False`: one array per owning layer, group after group
    in group order (within a group in layer order).
  - Otherwise, within each attention group of several layers the j-th layer is keyed by (j, block bytes, heads,
    head dim, dtype): the j-th layers of all groups with one page layout share one array. A group of one layer
    gets an array of its own. Layers of one group never share an array (they write the same blocks), layers of
    different groups do: their block tables never name the same block of the one shared pool.
  The arrays are numbered in the order their keys first occur (the `hybrid` layout); `layer` sorts them by their
  first layer, `shuffled` permutes them with `numpy.random.default_rng(seed)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from maxtext.configs.derived import KV_CACHE_LAYOUTS
from maxtext.configs.layer_kinds import ATTENTION_CACHE, RECURRENT_CACHE

ATTENTION = ATTENTION_CACHE
RECURRENT = RECURRENT_CACHE
# A bucket at most this many times the smallest sets the group size to its own count (vLLM's padding heuristic).
_LARGEST_BUCKET_RATIO = 1.5


def cdiv(a: int, b: int) -> int:
  """Ceiling division of non-negative ints."""
  return -(-a // b)


def _layer_number(name: str) -> int:
  return int(name.rsplit(".", 1)[1])


def spec_kind(name: str, spec: Any) -> str:
  """The spec's declared `cache_kind`: "attention" or "recurrent".

  Raises:
    TypeError: the object declares neither (it is not a cache spec).
  """
  kind = getattr(spec, "cache_kind", None)
  if kind not in (ATTENTION, RECURRENT):
    raise TypeError(
        f"{name}: a KV-cache spec must declare cache_kind {ATTENTION!r} or {RECURRENT!r} (an AttentionSpec or a"
        f" RecurrentSpec), got {type(spec).__name__} with cache_kind {kind!r}"
    )
  return kind


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
  """Layers that share one block table (attention) or the state-slot indices (recurrent).

  Attributes:
    group_id: index in `KVCacheManager.groups`.
    kind: "attention" or "recurrent".
    layer_names: every layer that reads this group's metadata, KV-shared layers included, in layer order.
    spec: the spec of the group's layers (with `hybrid_kv_cache=False`, the first attention layer's).
    block_size: tokens per block (None for the recurrent group).
    sliding_window: the window whose out-of-reach blocks are freed (None: the group keeps every block).
  """

  group_id: int
  kind: str
  layer_names: tuple[str, ...]
  spec: Any
  block_size: int | None
  sliding_window: int | None

  def describe(self) -> str:
    """A short name for messages, e.g. "group 1 (attention, sliding window 8, block_size 16)"."""
    if self.kind == RECURRENT:
      return f"group {self.group_id} (recurrent)"
    window = f"sliding window {self.sliding_window}" if self.sliding_window else "keeps all blocks"
    return f"group {self.group_id} (attention, {window}, block_size {self.block_size})"


@dataclasses.dataclass(frozen=True)
class CacheSlot:
  """One entry of the physical cache list.

  Attributes:
    slot: index in the list.
    kind: "attention" (one array) or "recurrent" (a (conv, recurrent) tuple).
    layer_names: the owning layers (layer order), then the KV-shared layers that read it.
    group_ids: the owners' groups, one per owner.
    spec: the first owner's spec (every owner's has the same layout).
    shapes: one shape (attention) or (conv shape, recurrent shape).
    dtypes: matching dtype names.
    nbytes: bytes of the entry.
  """

  slot: int
  kind: str
  layer_names: tuple[str, ...]
  group_ids: tuple[int, ...]
  spec: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  nbytes: int


@dataclasses.dataclass(frozen=True)
class GroupPlan:
  """One KV-cache group as planned: its kind and the owning layers (no KV-shared readers), in layer order."""

  kind: str
  layer_names: tuple[str, ...]


def plan_groups(
    owners: Sequence[str], specs: Mapping[str, Any], kinds: Mapping[str, str], hybrid_kv_cache: bool
) -> tuple[GroupPlan, ...]:
  """The KV-cache groups of the layers that own a cache (see the module docstring).

  Args:
    owners: the owning layers in layer order ("layer.<i>").
    specs: layer -> its spec (hashable; equal specs share a bucket).
    kinds: layer -> "attention" or "recurrent".
    hybrid_kv_cache: False puts every attention layer in one bucket.

  Returns:
    The groups, bucket after bucket.

  Raises:
    ValueError: no owning layers, or a layer without a spec or a kind.
  """
  if not owners:
    raise ValueError("plan_groups needs at least one layer that owns a cache")
  missing = [name for name in owners if name not in specs or kinds.get(name) not in (ATTENTION, RECURRENT)]
  if missing:
    raise ValueError(f"every owning layer needs a spec and a kind ('attention' or 'recurrent'); {missing} lack one")
  buckets: dict[Any, list[str]] = {}
  for name in owners:
    key = (ATTENTION,) if kinds[name] == ATTENTION and not hybrid_kv_cache else (kinds[name], specs[name])
    buckets.setdefault(key, []).append(name)
  if len(buckets) == 1 or not hybrid_kv_cache:
    return tuple(GroupPlan(key[0], tuple(names)) for key, names in buckets.items())
  counts = [len(names) for names in buckets.values()]
  size = min(counts)
  if max(counts) < size * _LARGEST_BUCKET_RATIO:
    size = max(counts)
  groups = []
  for key, names in buckets.items():
    num_groups = cdiv(len(names), size)
    groups.extend(GroupPlan(key[0], tuple(names[i::num_groups])) for i in range(num_groups))
  return tuple(groups)


def plan_arrays(
    groups: Sequence[GroupPlan], specs: Mapping[str, Any], hybrid_kv_cache: bool
) -> tuple[tuple[str, ...], ...]:
  """The physical arrays in tpu-inference's order: the owning layers of each (see the module docstring).

  Args:
    groups: from `plan_groups`.
    specs: layer -> spec; attention specs have `page_size_bytes()`, `num_kv_heads`, `head_dim`, `dtype`.
    hybrid_kv_cache: False gives every layer an array of its own.

  Returns:
    One tuple of owning layers (in layer order) per array.
  """
  one_per_layer = not hybrid_kv_cache or any(group.kind == RECURRENT for group in groups)
  arrays: dict[Any, list[str]] = {}
  for g, group in enumerate(groups):
    for j, name in enumerate(group.layer_names):
      if one_per_layer:
        key = ("layer", name)
      elif len(group.layer_names) == 1:
        key = ("group", g)
      else:
        spec = specs[name]
        key = ("position", j, spec.page_size_bytes(), spec.num_kv_heads, spec.head_dim, spec.dtype)
      arrays.setdefault(key, []).append(name)
  return tuple(tuple(sorted(names, key=_layer_number)) for names in arrays.values())


def order_arrays(arrays: Sequence[tuple[str, ...]], layout: str, seed: int) -> tuple[tuple[str, ...], ...]:
  """The arrays in the physical order of `kv_cache_layout`.

  Raises:
    ValueError: an unknown layout.
  """
  if layout == "hybrid":
    return tuple(arrays)
  if layout == "layer":
    return tuple(sorted(arrays, key=lambda names: _layer_number(names[0])))
  if layout == "shuffled":
    permutation = np.random.default_rng(seed).permutation(len(arrays))
    return tuple(arrays[int(p)] for p in permutation)
  raise ValueError(f"kv_cache_layout={layout!r}: must be one of {', '.join(KV_CACHE_LAYOUTS)}")
