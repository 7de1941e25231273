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

Prefix caching (`enable_prefix_caching=true`): cached blocks, the align scheme of recurrent states and the hit
rule are described in `prefix_cache.py` and docs/architecture.md.

Sliding-window freeing: a query at position q attends keys k with q - W < k <= q (W = window, self included).
Queries only move forward, so once a step starts at `num_computed_tokens = c`, no query of this or any later
step reads keys below `c - W + 1`: the first `(c - W + 1) // block_size` blocks are returned to the pool and
their block-table entries become the null block 0. A preempted request is recomputed from position 0 with fresh
blocks, so freed blocks are never needed again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from maxtext.configs.derived import KV_CACHE_LAYOUTS, state_block_size
from maxtext.configs.layer_kinds import ATTENTION_CACHE, RECURRENT_CACHE, get_layer_kind
from maxtext.inference.block_pool import NULL_BLOCK, BlockPool
from maxtext.inference import prefix_cache
from maxtext.inference.prefix_cache import PrefixHit, extend_block_hashes
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
      `max_num_reqs(cfg) + 1` (one slot per request the runner can hold, as upstream's compact mode), or
      `num_kv_blocks` state blocks under prefix caching (as upstream's align mode sizes them).

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
    self.enable_prefix_caching = bool(cfg.enable_prefix_caching)
    self.mamba_block_size = state_block_size(cfg)
    # Under prefix caching recurrent layers address state blocks through a block table (the align scheme).
    self.uses_state_blocks = self.enable_prefix_caching and self.has_recurrent
    if num_state_slots is None:
      num_state_slots = self.num_blocks if self.uses_state_blocks else max_num_reqs(cfg) + 1
    self.num_state_slots = num_state_slots
    self._slot_pool = StateSlotPool(num_state_slots) if self.has_recurrent and not self.uses_state_blocks else None
    self._pools = {g.group_id: BlockPool(self.num_blocks, name=g.describe()) for g in self.groups if g.kind == ATTENTION}
    self._tables: dict[str, dict[int, list[int]]] = {}
    self._num_allocated_tokens: dict[str, int] = {}
    self._state_slots: dict[str, int] = {}
    self.hash_block_size = self._hash_block_size()
    recurrent_name = next((f"{g.describe()} state blocks" for g in self.groups if g.kind == RECURRENT), "")
    self._state_pool = BlockPool(num_state_slots, name=recurrent_name) if self.uses_state_blocks else None
    self._state_tables: dict[str, list[int]] = {}  # request -> state block per mamba_block_size tokens (0: none)
    self._hashes: dict[str, list[bytes]] = {}  # request -> chained hashes of its full hash blocks
    self._num_registered: dict[str, dict[int, int]] = {}  # request -> group -> leading blocks registered
    logger.info(
        "KV-cache groups: %s; physical order (%s): %s",
        "; ".join(f"{g.describe()}: {', '.join(g.layer_names)}" for g in self.groups),
        cfg.kv_cache_layout,
        ", ".join(self.slot_owners),
    )

  # ------------------------------------------------------------------ construction
  def _hash_block_size(self) -> int:
    """Tokens per hashed block: the attention block size (all attention groups must share it under prefix
    caching), else `mamba_block_size`; a state block must then end where a hashed block ends."""
    sizes = sorted({g.block_size for g in self.groups if g.kind == ATTENTION})
    if not self.enable_prefix_caching:
      return sizes[0] if sizes else self.mamba_block_size
    if len(sizes) > 1:
      raise ValueError(
          f"enable_prefix_caching=true hashes blocks of one size, but the attention groups have block sizes {sizes}"
      )
    size = sizes[0] if sizes else self.mamba_block_size
    if self.has_recurrent and (self.mamba_block_size < 1 or self.mamba_block_size % size):
      raise ValueError(
          f"mamba_block_size={self.mamba_block_size}: must be a positive multiple of the attention block size {size}"
          " under enable_prefix_caching=true"
      )
    return size

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
    """Columns of a group's block table: `cdiv(max_target_length, block_size)`; for the recurrent group
    `mamba_block_size` under prefix caching (state blocks), else cfg.block_size (an all-zero table)."""
    group = self._group(group_id)
    if group.block_size is not None:
      block_size = group.block_size
    else:
      block_size = self.mamba_block_size if self.uses_state_blocks else int(self.cfg.block_size)
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
  def allocate_slots(
      self, request_id: str, num_computed_tokens: int, num_new_tokens: int, prefix_hit: PrefixHit | None = None
  ) -> bool:
    """Makes room for `num_new_tokens` more tokens of a request, in every group, all or nothing.

    After a True return each attention group's block table covers `cdiv(num_computed + num_new, block_size)`
    logical blocks, and the request holds a state slot (or, under prefix caching, a state block for the block of
    its last new token) when the model has recurrent layers. Sliding-window groups (hybrid_kv_cache=True) first
    return the blocks no query of this or a later step can read (see the module docstring), and the recurrent
    group the state blocks before the one this step reads; that happens even when the call then returns False.

    Args:
      request_id: the request.
      num_computed_tokens: tokens whose K/V are already in the cache (0 for a request not yet holding blocks, or
        `prefix_hit.num_tokens`).
      num_new_tokens: tokens computed in this step (>= 1).
      prefix_hit: for a request not yet holding blocks, the cached prefix it starts from (`find_prefix_hit`).

    Returns:
      False (nothing allocated) when some group lacks free blocks or no state slot is free.

    Raises:
      ValueError: bad token counts, `num_computed + num_new > max_target_length`, or a prefix hit for a request
        that already holds blocks or that disagrees with `num_computed_tokens`.
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
    if prefix_hit is not None:
      if known or not self.enable_prefix_caching:
        raise ValueError(
            f"request {request_id!r}: a prefix hit applies to a request holding no blocks with"
            f" enable_prefix_caching=true (holds blocks: {known}, enable_prefix_caching={self.enable_prefix_caching})"
        )
      if num_computed_tokens != prefix_hit.num_tokens:
        raise ValueError(
            f"request {request_id!r}: num_computed_tokens={num_computed_tokens} must equal the prefix hit's"
            f" {prefix_hit.num_tokens} tokens"
        )
      allocated = prefix_hit.num_tokens
    else:
      allocated = self._num_allocated_tokens.get(request_id, 0)
    if num_computed_tokens > allocated:
      raise ValueError(
          f"request {request_id!r}: num_computed_tokens={num_computed_tokens} but blocks exist only for"
          f" {allocated} tokens"
      )
    if known:
      self._free_out_of_window(request_id, num_computed_tokens)
      self._free_stale_states(request_id, num_computed_tokens)
      tables = self._tables[request_id]
    else:
      tables = {gid: list(prefix_hit.blocks[gid]) if prefix_hit else [] for gid in self._pools}
    needed = {gid: max(0, cdiv(total, self.groups[gid].block_size) - len(tables[gid])) for gid in self._pools}
    # The cached blocks a hit takes back (the free ones among them count against the free blocks).
    taken = {gid: [b for b in tables[gid] if b != NULL_BLOCK] if prefix_hit else [] for gid in self._pools}
    state_taken = [prefix_hit.state_block] if prefix_hit is not None and prefix_hit.state_block is not None else []
    for gid, n in needed.items():
      pool = self._pools[gid]
      reviving = sum(1 for b in taken[gid] if pool.refcount(b) == 0)
      if n + reviving > pool.num_free:
        logger.debug(
            "request %s: %s has %d free blocks, needs %d", request_id, self.groups[gid].describe(), pool.num_free, n
        )
        return False
    state_table, write_col = None, -1
    if self.uses_state_blocks:
      state_table = self._state_tables.get(request_id)
      if state_table is None:
        state_table = []
        if prefix_hit is not None and prefix_hit.state_block is not None:
          state_table = [NULL_BLOCK] * (prefix_hit.num_tokens // self.mamba_block_size - 1) + [prefix_hit.state_block]
      write_col = (total - 1) // self.mamba_block_size
      needs_state = write_col >= len(state_table) or state_table[write_col] == NULL_BLOCK
      reviving = sum(1 for b in state_taken if self._state_pool.refcount(b) == 0)
      if int(needs_state) + reviving > self._state_pool.num_free:
        logger.debug("request %s: no free state block", request_id)
        return False
    needs_slot = self._slot_pool is not None and request_id not in self._state_slots
    if needs_slot and self._slot_pool.num_free == 0:
      logger.debug("request %s: no free state slot", request_id)
      return False
    for gid, blocks in taken.items():
      self._pools[gid].take(blocks)
    for gid, n in needed.items():
      tables[gid].extend(self._pools[gid].allocate(n))
    if state_table is not None:
      self._state_pool.take(state_taken)
      state_table.extend([NULL_BLOCK] * (write_col + 1 - len(state_table)))
      if state_table[write_col] == NULL_BLOCK:
        state_table[write_col] = self._state_pool.allocate(1)[0]
      self._state_tables[request_id] = state_table
    if needs_slot:
      self._state_slots[request_id] = self._slot_pool.acquire()
    if not known and self.enable_prefix_caching:  # a hit's blocks are registered already
      hit_tokens = prefix_hit.num_tokens if prefix_hit is not None else 0
      self._num_registered[request_id] = {gid: hit_tokens // self.groups[gid].block_size for gid in tables}
    self._tables[request_id] = tables
    self._num_allocated_tokens[request_id] = max(allocated, total)
    return True

  def schedulable_tokens(self, num_computed_tokens: int, num_new_tokens: int) -> int:
    """How many of `num_new_tokens` a step may compute: under the align scheme a step stops at the next state
    boundary (a multiple of `mamba_block_size`), so the state there is really written; otherwise all of them."""
    if not self.uses_state_blocks:
      return num_new_tokens
    next_boundary = (num_computed_tokens // self.mamba_block_size + 1) * self.mamba_block_size
    return min(num_new_tokens, next_boundary - num_computed_tokens)

  def find_prefix_hit(self, token_ids: Sequence[int]) -> PrefixHit:
    """The longest cached prefix of `token_ids` every group hits (a miss has `num_tokens == 0`).

    At most `len(token_ids) - 1` tokens (the last one must be computed to sample). The length starts at that
    limit in whole hashed blocks and is lowered to what each group holds, group after group, until no group
    lowers it: a full-attention group holds the longest run of cached leading blocks; a sliding-window group a
    resume point whose window blocks are all cached; the recurrent group a state boundary whose state block is
    cached. So the hit is the largest length at which EVERY group hits, on a state boundary.

    Raises:
      ValueError: prefix caching is off.
    """
    if not self.enable_prefix_caching:
      raise ValueError("find_prefix_hit needs enable_prefix_caching=true")
    size = self.hash_block_size
    hashes = extend_block_hashes([], token_ids, size)
    hits = [functools.partial(self._group_hit, group, hashes) for group in self.groups]
    limit = prefix_cache.common_hit(hits, max(0, len(token_ids) - 1) // size)
    blocks = {}
    for gid, pool in self._pools.items():
      group = self.groups[gid]
      count = limit * size // group.block_size
      first = prefix_cache.first_window_block(count * group.block_size, group.block_size, group.sliding_window)
      blocks[gid] = tuple(NULL_BLOCK if j < first else pool.lookup(hashes[j]) for j in range(count))
    state_block = None
    if self.uses_state_blocks and limit:
      state_block = self._state_pool.lookup(hashes[limit - 1])
    return PrefixHit(limit * size, blocks, state_block)

  def group_prefix_hits(self, token_ids: Sequence[int]) -> dict[int, int]:
    """Group id -> tokens of the longest prefix of `token_ids` that group alone holds cached (at most
    `len(token_ids) - 1`); `find_prefix_hit` takes the largest length all groups agree on. For diagnostics.

    Raises:
      ValueError: prefix caching is off.
    """
    if not self.enable_prefix_caching:
      raise ValueError("group_prefix_hits needs enable_prefix_caching=true")
    hashes = extend_block_hashes([], token_ids, self.hash_block_size)
    limit = max(0, len(token_ids) - 1) // self.hash_block_size
    return {g.group_id: self._group_hit(g, hashes, limit) * self.hash_block_size for g in self.groups}

  def _group_hit(self, group: KVCacheGroup, hashes: Sequence[bytes], limit: int) -> int:
    """The largest prefix of at most `limit` hashed blocks this group holds cached (see `find_prefix_hit`)."""
    if group.kind == RECURRENT:
      return prefix_cache.state_hit(self._state_pool.lookup, hashes, limit, self.mamba_block_size // self.hash_block_size)
    lookup = self._pools[group.group_id].lookup
    return prefix_cache.attention_hit(lookup, hashes, limit, group.block_size, group.sliding_window)

  def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
    """Registers the request's blocks completed by `num_computed_tokens` (their K/V or state written) under the
    hashes of `token_ids`, so later requests can find them. A no-op without prefix caching.

    Call it after the step that computed them (the scheduler does, in `update_from_output`).

    Raises:
      ValueError: the request holds no blocks, or fewer tokens than computed are given.
    """
    if not self.enable_prefix_caching:
      return
    tables = self._request_tables(request_id)
    if len(token_ids) < num_computed_tokens:
      raise ValueError(
          f"request {request_id!r}: {len(token_ids)} token ids given for {num_computed_tokens} computed tokens"
      )
    hashes = extend_block_hashes(
        self._hashes.setdefault(request_id, []), token_ids[:num_computed_tokens], self.hash_block_size
    )
    registered = self._num_registered[request_id]
    for gid, table in tables.items():
      full = min(num_computed_tokens // self.groups[gid].block_size, len(table))
      for j in range(registered[gid], full):
        if table[j] != NULL_BLOCK:
          self._pools[gid].cache_block(table[j], hashes[j])
      registered[gid] = max(registered[gid], full)
    if self.uses_state_blocks and num_computed_tokens and num_computed_tokens % self.mamba_block_size == 0:
      table = self._state_tables[request_id]
      col = num_computed_tokens // self.mamba_block_size - 1
      if col < len(table) and table[col] != NULL_BLOCK:
        self._state_pool.cache_block(table[col], hashes[num_computed_tokens // self.hash_block_size - 1])

  def _free_stale_states(self, request_id: str, num_computed_tokens: int) -> None:
    """Returns the state blocks before the one a step starting at `num_computed_tokens` reads."""
    table = self._state_tables.get(request_id)
    if table is None:
      return
    read_col = max(num_computed_tokens - 1, 0) // self.mamba_block_size
    stale = [b for b in table[:read_col] if b != NULL_BLOCK]
    if stale:
      self._state_pool.free(stale)
      table[:read_col] = [NULL_BLOCK] * read_col

  def _free_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
    for gid, table in self._tables[request_id].items():
      group = self.groups[gid]
      if not group.sliding_window:
        continue
      first = prefix_cache.first_window_block(num_computed_tokens, group.block_size, group.sliding_window)
      num_dead = min(first, len(table))
      dead = [b for b in table[:num_dead] if b != NULL_BLOCK]
      if dead:
        self._pools[gid].free(dead)
        table[:num_dead] = [NULL_BLOCK] * num_dead

  def free(self, request_id: str) -> None:
    """Returns every block of the request in every group, and its state slot (recorded for zeroing) or state
    blocks. Blocks are freed last first, so cached prefix blocks are evicted after the blocks that follow them.

    Raises:
      ValueError: the request holds nothing (never allocated, or already freed).
    """
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    for gid, table in self._tables.pop(request_id).items():
      self._pools[gid].free([b for b in reversed(table) if b != NULL_BLOCK])
    del self._num_allocated_tokens[request_id]
    if request_id in self._state_slots:
      self._slot_pool.release(self._state_slots.pop(request_id))
    if request_id in self._state_tables:
      self._state_pool.free([b for b in reversed(self._state_tables.pop(request_id)) if b != NULL_BLOCK])
    self._hashes.pop(request_id, None)
    self._num_registered.pop(request_id, None)

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
      if self.uses_state_blocks:
        raise ValueError("under prefix caching recurrent layers use state blocks; see state_block_table")
      raise ValueError("the model has no recurrent layers, so requests hold no state slots")
    if request_id not in self._state_slots:
      raise ValueError(f"request {request_id!r} holds no state slot (never allocated, or already freed)")
    return self._state_slots[request_id]

  def state_block_table(self, request_id: str) -> list[int]:
    """A copy of the request's state-block table under prefix caching (0 = no state block in that column).

    Raises:
      ValueError: prefix caching is off or the model has no recurrent layers, or the request holds no blocks.
    """
    if not self.uses_state_blocks:
      raise ValueError("state block tables exist only with recurrent layers and enable_prefix_caching=true")
    self._request_tables(request_id)
    return list(self._state_tables[request_id])

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
    """Free state slots, or state blocks under prefix caching (0 when the model has no recurrent layers)."""
    if self._state_pool is not None:
      return self._state_pool.num_free
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

  def _request_tables(self, request_id: str) -> dict[int, list[int]]:
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    return self._tables[request_id]

  def _group(self, group_id: int) -> KVCacheGroup:
    if not 0 <= group_id < len(self.groups):
      raise ValueError(f"group_id {group_id} is out of range: there are {len(self.groups)} KV-cache groups")
    return self.groups[group_id]
