"""KV-cache groups, the physical cache list, and per-request block / state-slot allocation.

Groups (what shares one block table), from the per-layer specs (`get_kv_cache_specs`, KV-shared layers absent):
  - `hybrid_kv_cache=True`: one attention group per distinct attention spec (full attention, and each sliding
    window, are separate groups with separate block pools); sliding-window groups return blocks that no query can
    reach any more to their pool.
  - `hybrid_kv_cache=False`: ONE attention group for every attention layer; every layer keeps every block (the
    window is still applied by the attention math).
  - recurrent layers (Gated DeltaNet, any kind whose spec has cache_kind "recurrent") form one more group: they
    hold no blocks but one state slot per request, the same slot in every recurrent layer's arrays.
  Groups are numbered in order of first occurrence in layer order (as vLLM buckets specs), so a Qwen3-Next model,
  whose layer 0 is GDN, has the recurrent group first. A KV-shared layer belongs to its source's group.

Physical cache list (`cfg.kv_cache_layout`), one entry per layer that owns a cache (KV-shared layers own none):
  - `layer`: entries in layer order;
  - `hybrid`: every recurrent layer first (layer order), then every attention layer (as tpu-inference allocates);
  - `shuffled`: the layer order permuted by `numpy.random.default_rng(cfg.seed).permutation`.
  `layer_name_to_kvcache_index` names the entry of EVERY layer; KV-shared layers point at their source's entry.

Sliding-window freeing: a query at position q attends keys k with q - W < k <= q (W = window, self included).
Queries only move forward, so once a step starts at `num_computed_tokens = c`, no query of this or any later
step reads keys below `c - W + 1`: the first `(c - W + 1) // block_size` blocks are returned to the pool and
their block-table entries become the null block 0. A preempted request is recomputed from position 0 with fresh
blocks, so freed blocks are never needed again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxtext.configs.derived import KV_CACHE_LAYOUTS
from maxtext.configs.layer_kinds import ATTENTION_CACHE, RECURRENT_CACHE, get_layer_kind
from maxtext.inference.block_pool import NULL_BLOCK, BlockPool
from maxtext.inference.state_slots import StateSlotPool
from maxtext.integration.vllm import hybrid_cache_utils

logger = logging.getLogger(__name__)

ATTENTION = ATTENTION_CACHE
RECURRENT = RECURRENT_CACHE
MIN_REQUEST_BUCKET = 8


def cdiv(a: int, b: int) -> int:
  """Ceiling division of non-negative ints."""
  return -(-a // b)


def max_num_reqs(cfg: Any) -> int:
  """Requests the runner holds at once, and the request rows of the metadata arrays: `max(max_num_seqs, 8)`."""
  return max(int(cfg.max_num_seqs), MIN_REQUEST_BUCKET)


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
    layer_names: the owning layer first, then the KV-shared layers that read it.
    group_id: the owner's group.
    spec: the owner's spec.
    shapes: one shape (attention) or (conv shape, recurrent shape).
    dtypes: matching dtype names.
    nbytes: bytes of the entry.
  """

  slot: int
  kind: str
  layer_names: tuple[str, ...]
  group_id: int
  spec: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  nbytes: int


def _layer_index(name: str, where: str) -> int:
  return hybrid_cache_utils.parse_layer_name(name, where)


class KVCacheManager:
  """Forms the KV-cache groups and the physical cache list, and allocates blocks and state slots per request.

  Args:
    cfg: the loaded config (reads base_num_decoder_layers, layer_types, hybrid_kv_cache, kv_cache_layout, seed,
      num_kv_blocks, max_target_length, max_num_seqs, block_size).
    specs: "layer.<i>" -> attention or recurrent spec, for every layer that owns a cache.
    shared_layers: "layer.<i>" (KV-shared) -> "layer.<source>" (an attention layer in `specs`).
    num_state_slots: rows M of every recurrent state array, including the null slot 0; default
      `max_num_reqs(cfg) + 1` (one slot per request the runner can hold, as upstream's compact mode).

  Raises:
    ValueError: layer names do not cover `layer.0 .. layer.<L-1>` exactly once, a spec disagrees with
      `cfg.layer_types`, a shared layer's source is not an attention layer with a spec, attention specs in one
      group have different block sizes, or an unknown `kv_cache_layout`.
    TypeError: a spec declares no cache kind.
  """

  def __init__(
      self, cfg: Any, specs: Mapping[str, Any], shared_layers: Mapping[str, str], *, num_state_slots: int | None = None
  ):
    self.cfg = cfg
    self.num_layers = int(cfg.base_num_decoder_layers)
    self.num_blocks = int(cfg.num_kv_blocks)
    self.max_target_length = int(cfg.max_target_length)
    self._specs = dict(specs)
    self._shared = dict(shared_layers)
    self._kinds = self._validate_layers(cfg)
    self.groups = self._form_groups(bool(cfg.hybrid_kv_cache))
    self._group_of_layer = {name: g.group_id for g in self.groups for name in g.layer_names}
    self.slot_owners = self._physical_order(cfg.kv_cache_layout, int(cfg.seed))
    owner_slot = {name: slot for slot, name in enumerate(self.slot_owners)}
    slots = []
    for i in range(self.num_layers):
      name = hybrid_cache_utils.layer_name(i)
      slots.append((name, owner_slot[self._shared.get(name, name)]))
    self.layer_name_to_kvcache_index: tuple[tuple[str, int], ...] = tuple(slots)

    self.has_recurrent = any(kind == RECURRENT for kind in self._kinds.values())
    if num_state_slots is None:
      num_state_slots = max_num_reqs(cfg) + 1
    self.num_state_slots = num_state_slots
    self._slot_pool = StateSlotPool(num_state_slots) if self.has_recurrent else None
    self._pools = {g.group_id: BlockPool(self.num_blocks, name=g.describe()) for g in self.groups if g.kind == ATTENTION}
    self._tables: dict[str, dict[int, list[int]]] = {}
    self._num_allocated_tokens: dict[str, int] = {}
    self._state_slots: dict[str, int] = {}
    logger.info(
        "KV-cache groups: %s; physical order (%s): %s",
        "; ".join(f"{g.describe()}: {', '.join(g.layer_names)}" for g in self.groups),
        cfg.kv_cache_layout,
        ", ".join(self.slot_owners),
    )

  # ------------------------------------------------------------------ construction
  def _validate_layers(self, cfg: Any) -> dict[str, str]:
    """Checks the names against the config; returns the kind of every layer that owns a cache."""
    layer_types = tuple(cfg.layer_types)
    expected = {hybrid_cache_utils.layer_name(i) for i in range(self.num_layers)}
    for name in list(self._specs) + list(self._shared):
      _layer_index(name, "KVCacheManager")
    overlap = sorted(set(self._specs) & set(self._shared), key=lambda n: _layer_index(n, ""))
    if overlap:
      raise ValueError(f"{overlap[0]} has a spec and is also a KV-shared layer; a shared layer must have no spec")
    given = set(self._specs) | set(self._shared)
    if given != expected:
      missing = sorted(expected - given, key=lambda n: _layer_index(n, ""))
      extra = sorted(given - expected, key=lambda n: _layer_index(n, ""))
      raise ValueError(
          f"specs and shared layers must name layer.0 .. layer.{self.num_layers - 1} exactly once"
          f" (base_num_decoder_layers={self.num_layers}); missing {missing}, unexpected {extra}"
      )
    kinds = {}
    for name, spec in self._specs.items():
      kind = spec_kind(name, spec)
      configured = layer_types[_layer_index(name, "")]
      declared = get_layer_kind(configured)
      article = "an" if kind == ATTENTION else "a"
      if declared is not None and declared.cache_kind != kind:
        raise ValueError(
            f"{name} has {article} {kind} spec but cfg.layer_types says {configured}, whose caches are"
            f" {declared.cache_kind}"
        )
      if spec.layer_type != configured:
        raise ValueError(
            f"{name} has {article} {kind} spec of type {spec.layer_type} but cfg.layer_types says {configured}"
        )
      kinds[name] = kind
    for name, source in self._shared.items():
      if source not in self._specs or kinds[source] != ATTENTION:
        raise ValueError(f"KV-shared {name} reads {source}, which must be an attention layer with its own spec")
    return kinds

  def _form_groups(self, hybrid_kv_cache: bool) -> tuple[KVCacheGroup, ...]:
    keys: dict[Any, list[str]] = {}  # insertion order = first occurrence in layer order
    for i in range(self.num_layers):
      name = hybrid_cache_utils.layer_name(i)
      owner = self._shared.get(name, name)
      spec = self._specs[owner]
      if self._kinds[owner] == RECURRENT:
        key = RECURRENT
      elif hybrid_kv_cache:
        key = (ATTENTION, spec)
      else:
        key = ATTENTION
      keys.setdefault(key, []).append(name)
    groups = []
    for group_id, (key, names) in enumerate(keys.items()):
      first = self._specs[self._shared.get(names[0], names[0])]
      if key == RECURRENT:
        groups.append(KVCacheGroup(group_id, RECURRENT, tuple(names), first, None, None))
        continue
      for name in names:
        block_size = self._specs[self._shared.get(name, name)].block_size
        if block_size != first.block_size:
          raise ValueError(
              f"hybrid_kv_cache=False puts every attention layer in one KV-cache group, which needs one block size:"
              f" {names[0]} has block_size {first.block_size} but {name} has {block_size}"
          )
      window = first.sliding_window if hybrid_kv_cache and first.sliding_window else None
      groups.append(KVCacheGroup(group_id, ATTENTION, tuple(names), first, int(first.block_size), window))
    return tuple(groups)

  def _physical_order(self, layout: str, seed: int) -> tuple[str, ...]:
    names = [hybrid_cache_utils.layer_name(i) for i in range(self.num_layers)]
    owners = [name for name in names if name in self._specs]
    if layout == "layer":
      return tuple(owners)
    if layout == "hybrid":
      return tuple(
          [n for n in owners if self._kinds[n] == RECURRENT] + [n for n in owners if self._kinds[n] == ATTENTION]
      )
    if layout == "shuffled":
      permutation = np.random.default_rng(seed).permutation(len(owners))
      return tuple(owners[int(p)] for p in permutation)
    raise ValueError(f"kv_cache_layout={layout!r}: must be one of {', '.join(KV_CACHE_LAYOUTS)}")

  # ------------------------------------------------------------------ physical caches
  @property
  def recurrent_slot_indices(self) -> tuple[int, ...]:
    """Indices of the physical list that hold recurrent state tuples (their rows are state slots)."""
    return tuple(i for i, owner in enumerate(self.slot_owners) if self._kinds[owner] == RECURRENT)

  @property
  def attention_group_ids(self) -> tuple[int, ...]:
    """Ids of the groups that hold blocks."""
    return tuple(g.group_id for g in self.groups if g.kind == ATTENTION)

  def group_of_layer(self, layer_name: str) -> int:
    """The group id of a layer (KV-shared layers: their source's group)."""
    if layer_name not in self._group_of_layer:
      raise ValueError(f"unknown layer {layer_name!r}; layers are layer.0 .. layer.{self.num_layers - 1}")
    return self._group_of_layer[layer_name]

  def max_blocks_per_req(self, group_id: int) -> int:
    """Columns of a group's block table: `cdiv(max_target_length, block_size)` (cfg.block_size for recurrent)."""
    group = self._group(group_id)
    block_size = group.block_size if group.block_size is not None else int(self.cfg.block_size)
    return cdiv(self.max_target_length, block_size)

  def describe_slots(self, num_blocks: int | None = None) -> tuple[CacheSlot, ...]:
    """One description per physical cache entry, in physical order (for a layout printout).

    Args:
      num_blocks: blocks per attention cache array (default `cfg.num_kv_blocks`).
    """
    num_blocks = self._check_num_blocks(num_blocks)
    users: dict[str, list[str]] = {owner: [owner] for owner in self.slot_owners}
    for i in range(self.num_layers):
      name = hybrid_cache_utils.layer_name(i)
      if name in self._shared:
        users[self._shared[name]].append(name)
    described = []
    for slot, owner in enumerate(self.slot_owners):
      spec = self._specs[owner]
      if self._kinds[owner] == RECURRENT:
        shapes = tuple(tuple(s) for s in spec.cache_shapes(self.num_state_slots))
        dtypes = tuple(str(d) for d in spec.state_dtypes)
        nbytes = int(spec.slot_size_bytes()) * self.num_state_slots
      else:
        shapes = (tuple(spec.cache_shape(num_blocks)),)
        dtypes = (str(spec.dtype),)
        nbytes = int(spec.page_size_bytes()) * num_blocks
      described.append(
          CacheSlot(
              slot, self._kinds[owner], tuple(users[owner]), self._group_of_layer[owner], spec, shapes, dtypes, nbytes
          )
      )
    return tuple(described)

  def format_layout(self, num_blocks: int | None = None) -> str:
    """A human-readable table of the physical cache list and the groups."""
    lines = [f"kv_cache_layout={self.cfg.kv_cache_layout} hybrid_kv_cache={bool(self.cfg.hybrid_kv_cache)}"]
    for group in self.groups:
      lines.append(f"{group.describe()}: {', '.join(group.layer_names)}")
    total = 0
    for entry in self.describe_slots(num_blocks):
      arrays = " + ".join(f"{shape} {dtype}" for shape, dtype in zip(entry.shapes, entry.dtypes))
      shared = f" (shared by {', '.join(entry.layer_names[1:])})" if len(entry.layer_names) > 1 else ""
      lines.append(
          f"kv_caches[{entry.slot}]: {entry.layer_names[0]}{shared} {entry.kind} group {entry.group_id}:"
          f" {arrays} = {entry.nbytes} bytes"
      )
      total += entry.nbytes
    lines.append(f"total: {total} bytes")
    return "\n".join(lines)

  def allocate_caches(self, num_blocks: int | None = None) -> list[Any]:
    """Zero-filled physical caches in the runner's shapes and dtypes, in physical order.

    Attention entry: one array `spec.cache_shape(num_blocks)`; recurrent entry: a tuple of zero arrays
    `spec.cache_shapes(M)` in `spec.state_dtypes` (Gated DeltaNet: conv `[M, K-1, conv_dim]`, recurrent
    `[M, nv, dk, dv]`).

    Args:
      num_blocks: blocks per attention array (default `cfg.num_kv_blocks`; must be at least that, or block ids the
        pools hand out would fall outside the arrays).
    """
    num_blocks = self._check_num_blocks(num_blocks)
    caches: list[Any] = []
    for owner in self.slot_owners:
      spec = self._specs[owner]
      if self._kinds[owner] == RECURRENT:
        shapes = spec.cache_shapes(self.num_state_slots)
        caches.append(tuple(jnp.zeros(shape, dtype) for shape, dtype in zip(shapes, spec.state_dtypes)))
      else:
        caches.append(jnp.zeros(spec.cache_shape(num_blocks), spec.dtype))
    return caches

  def _check_num_blocks(self, num_blocks: int | None) -> int:
    if num_blocks is None:
      return self.num_blocks
    if num_blocks < self.num_blocks:
      raise ValueError(
          f"num_blocks={num_blocks} is smaller than the block pools (num_kv_blocks={self.num_blocks}); block ids"
          " beyond the array would be out of range"
      )
    return num_blocks

  # ------------------------------------------------------------------ per-request allocation
  def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
    """Makes room for `num_new_tokens` more tokens of a request, in every attention group, all or nothing.

    After a True return each attention group's block table covers `cdiv(num_computed + num_new, block_size)`
    logical blocks, and the request holds a state slot when the model has recurrent layers (taken here on the
    request's first allocation). Sliding-window groups (hybrid_kv_cache=True) first return the blocks no query of
    this or a later step can read (see the module docstring); that happens even when the call then returns False.

    Args:
      request_id: the request.
      num_computed_tokens: tokens whose K/V are already in the cache (0 for a request not yet holding blocks).
      num_new_tokens: tokens computed in this step (>= 1).

    Returns:
      False (nothing allocated) when some group lacks free blocks or no state slot is free.

    Raises:
      ValueError: bad token counts, or `num_computed + num_new > max_target_length`.
    """
    if num_computed_tokens < 0 or num_new_tokens < 1:
      raise ValueError(
          f"request {request_id!r}: need num_computed_tokens >= 0 and num_new_tokens >= 1, got {num_computed_tokens}"
          f" and {num_new_tokens}"
      )
    total = num_computed_tokens + num_new_tokens
    if total > self.max_target_length:
      raise ValueError(
          f"request {request_id!r}: {total} tokens exceed max_target_length={self.max_target_length} (the block"
          " tables have no room for them)"
      )
    known = request_id in self._tables
    allocated = self._num_allocated_tokens.get(request_id, 0)
    if num_computed_tokens > allocated:
      raise ValueError(
          f"request {request_id!r}: num_computed_tokens={num_computed_tokens} but blocks exist only for"
          f" {allocated} tokens"
      )
    if known:
      self._free_out_of_window(request_id, num_computed_tokens)
    tables = self._tables.get(request_id, {gid: [] for gid in self._pools})
    needed = {gid: max(0, cdiv(total, self.groups[gid].block_size) - len(tables[gid])) for gid in self._pools}
    for gid, n in needed.items():
      if n > self._pools[gid].num_free:
        logger.debug(
            "request %s: %s has %d free blocks, needs %d",
            request_id,
            self.groups[gid].describe(),
            self._pools[gid].num_free,
            n,
        )
        return False
    needs_slot = self._slot_pool is not None and request_id not in self._state_slots
    if needs_slot and self._slot_pool.num_free == 0:
      logger.debug("request %s: no free state slot", request_id)
      return False
    for gid, n in needed.items():
      tables[gid].extend(self._pools[gid].allocate(n))
    if needs_slot:
      self._state_slots[request_id] = self._slot_pool.acquire()
    self._tables[request_id] = tables
    self._num_allocated_tokens[request_id] = max(allocated, total)
    return True

  def _free_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
    for gid, table in self._tables[request_id].items():
      group = self.groups[gid]
      if not group.sliding_window:
        continue
      first_needed_key = num_computed_tokens - group.sliding_window + 1
      num_dead = min(max(0, first_needed_key // group.block_size), len(table))
      dead = [b for b in table[:num_dead] if b != NULL_BLOCK]
      if dead:
        self._pools[gid].free(dead)
        table[:num_dead] = [NULL_BLOCK] * num_dead

  def free(self, request_id: str) -> None:
    """Returns every block of the request in every group, and its state slot (recorded for zeroing).

    Raises:
      ValueError: the request holds nothing (never allocated, or already freed).
    """
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    for gid, table in self._tables.pop(request_id).items():
      self._pools[gid].free([b for b in table if b != NULL_BLOCK])
    del self._num_allocated_tokens[request_id]
    if request_id in self._state_slots:
      self._slot_pool.release(self._state_slots.pop(request_id))

  def has_request(self, request_id: str) -> bool:
    """Whether the request holds blocks / a state slot."""
    return request_id in self._tables

  def block_table(self, request_id: str, group_id: int) -> list[int]:
    """A copy of the request's block table in an attention group (0 = a freed out-of-window block)."""
    group = self._group(group_id)
    if group.kind != ATTENTION:
      raise ValueError(f"{group.describe()} holds no blocks; recurrent layers use get_state_slot")
    return list(self._request_tables(request_id)[group_id])

  def get_state_slot(self, request_id: str) -> int:
    """The request's recurrent state slot (>= 1).

    Raises:
      ValueError: the model has no recurrent layers, or the request holds no slot.
    """
    if self._slot_pool is None:
      raise ValueError("the model has no recurrent layers, so requests hold no state slots")
    if request_id not in self._state_slots:
      raise ValueError(f"request {request_id!r} holds no state slot (never allocated, or already freed)")
    return self._state_slots[request_id]

  def drain_slots_to_zero(self) -> list[int]:
    """State slots released since the last call; the engine zeroes these rows of every recurrent cache."""
    return [] if self._slot_pool is None else self._slot_pool.drain_slots_to_zero()

  def num_free_blocks(self, group_id: int) -> int:
    """Free blocks of an attention group."""
    group = self._group(group_id)
    if group.kind != ATTENTION:
      raise ValueError(f"{group.describe()} holds no blocks")
    return self._pools[group_id].num_free

  def num_free_state_slots(self) -> int:
    """Free state slots (0 when the model has no recurrent layers)."""
    return 0 if self._slot_pool is None else self._slot_pool.num_free

  def check_request_fits(self, request_id: str, num_tokens: int) -> None:
    """Raises when `num_tokens` can never be held by one request in a group that keeps every block.

    (Sliding-window groups only hold a window's worth of blocks, so the scheduler checks them while running.)

    Raises:
      ValueError: naming the request, the group and the numbers.
    """
    for gid, pool in self._pools.items():
      group = self.groups[gid]
      needed = cdiv(num_tokens, group.block_size)
      if not group.sliding_window and needed > pool.num_blocks - 1:
        raise ValueError(
            f"request {request_id!r}: {num_tokens} tokens need {needed} blocks in {group.describe()}, but the pool"
            f" has {pool.num_blocks - 1} (num_kv_blocks={self.num_blocks}, block 0 is reserved); raise num_kv_blocks"
        )

  def all_free(self) -> bool:
    """Leak check: no request holds anything and every block and state slot is free."""
    slots_free = self._slot_pool is None or self._slot_pool.num_used == 0
    return not self._tables and slots_free and all(p.num_used == 0 for p in self._pools.values())

  def _request_tables(self, request_id: str) -> dict[int, list[int]]:
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    return self._tables[request_id]

  def _group(self, group_id: int) -> KVCacheGroup:
    if not 0 <= group_id < len(self.groups):
      raise ValueError(f"group_id {group_id} is out of range: there are {len(self.groups)} KV-cache groups")
    return self.groups[group_id]
