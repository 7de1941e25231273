"""KV-cache groups, one shared block pool, the physical cache list, and per-request block / state-slot allocation.

Groups and arrays (`kv_cache_groups.py` has the rules, vLLM's and tpu-inference 0.32.0's): with
`hybrid_kv_cache=True` layers are bucketed by spec and every bucket is split into groups of one size (a 5:1
sliding:full model of 12 layers: 6 groups of 2 layers), and the j-th layers of the attention groups share one
array (2 arrays of 6 layers); with `hybrid_kv_cache=False` every attention layer is in ONE group that keeps every
block (the window is still applied by the attention math) and every layer has an array of its own. Recurrent layers
(Gated DeltaNet, any spec with cache_kind "recurrent") form groups too; they hold no blocks but one state slot per
request, the same slot in every recurrent array, and a model with them keeps one array per layer. A KV-shared layer
belongs to its source's group and reads its source's array.

One block pool serves every attention group (as vLLM's): each group's block tables draw block ids from it, and
an id names the same block in every array. Layers sharing an array are of different groups, whose tables never
hold one block at once, so their writes never meet. Blocks a sliding-window group frees serve any group next.
The pool has `num_kv_blocks` blocks when that is set, else as many as `kv_cache_memory_bytes` holds: those bytes
less the recurrent state slots, divided by the bytes of one block over every attention array (under prefix
caching a state block joins each block, as the align scheme has one per block). When neither is set, 256 blocks per
attention group: the bytes a layer's cache would take if every group had a pool of 256 blocks of its own.

Physical cache list (`cfg.kv_cache_layout`), one entry per array:
  - `hybrid`: tpu-inference's order (its slot keys in order of first occurrence; recurrent models: group by group);
  - `layer`: sorted by each array's first layer;
  - `shuffled`: the `hybrid` order permuted by `numpy.random.default_rng(cfg.seed).permutation`.
  `layer_name_to_kvcache_index` names the entry of EVERY layer; KV-shared layers point at their source's entry.

Prefix caching (`enable_prefix_caching=true`): cached blocks, the align scheme of recurrent states and the hit
rule are described in `prefix_cache.py` and docs/architecture.md. The shared pool registers a block under its
group and hash, so groups never take each other's blocks.

Sliding-window freeing: a query at position q attends keys k with q - W < k <= q (W = window, self included).
Queries only move forward, so once a step starts at `num_computed_tokens = c`, no query of this or any later
step reads keys below `c - W + 1`: the first `(c - W + 1) // block_size` blocks are returned to the pool and
their block-table entries become the null block 0. A preempted request starts again from position 0 with fresh
blocks, or under prefix caching from the cached prefix it is given back (`find_prefix_hit`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from maxtext.configs.derived import state_block_size
from maxtext.configs.layer_kinds import ATTENTION_CACHE, RECURRENT_CACHE, get_layer_kind
from maxtext.inference.block_pool import NULL_BLOCK, BlockPool
from maxtext.kv_cache.kv_cache_groups import (
    CacheSlot,
    KVCacheGroup,
    cdiv,
    order_arrays,
    plan_arrays,
    plan_groups,
    spec_kind,
)
from maxtext.inference import prefix_cache
from maxtext.inference.prefix_cache import PrefixHit, extend_block_hashes
from maxtext.inference.state_slots import StateSlotPool
from maxtext.kv_cache import hybrid_cache_utils

logger = logging.getLogger(__name__)
_NO_ROOM = -2  # `_state_table_plan`: no state block is free

ATTENTION = ATTENTION_CACHE
RECURRENT = RECURRENT_CACHE
MIN_REQUEST_BUCKET = 8
DEFAULT_NUM_KV_BLOCKS = 256  # per attention group: the pool when neither num_kv_blocks nor kv_cache_memory_bytes is set


def max_num_reqs(cfg: Any) -> int:
  """Requests the runner holds at once, and the request rows of the metadata arrays: `max(max_num_seqs, 8)`."""
  return max(int(cfg.max_num_seqs), MIN_REQUEST_BUCKET)


def _layer_index(name: str, where: str = "") -> int:
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
    self.max_target_length = int(cfg.max_target_length)
    self._specs = dict(specs)
    self._shared = dict(shared_layers)
    self._kinds = self._validate_layers(cfg)
    self.groups = self._form_groups(bool(cfg.hybrid_kv_cache))
    self._group_of_layer = {name: g.group_id for g in self.groups for name in g.layer_names}
    self.slot_owners: tuple[tuple[str, ...], ...] = order_arrays(
        plan_arrays(self._plans, self._specs, bool(cfg.hybrid_kv_cache)), cfg.kv_cache_layout, int(cfg.seed)
    )
    owner_slot = {name: slot for slot, names in enumerate(self.slot_owners) for name in names}
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
    self.num_blocks = self._pool_num_blocks(cfg)
    if num_state_slots is None:
      num_state_slots = self.num_blocks if self.uses_state_blocks else max_num_reqs(cfg) + 1
    self.num_state_slots = num_state_slots
    self._slot_pool = StateSlotPool(num_state_slots) if self.has_recurrent and not self.uses_state_blocks else None
    self._pool = BlockPool(self.num_blocks, name="the KV-cache block pool")
    self._tables: dict[str, dict[int, list[int]]] = {}
    self._num_allocated_tokens: dict[str, int] = {}
    self._state_slots: dict[str, int] = {}
    self.hash_block_size = self._hash_block_size()
    self._state_pool = BlockPool(num_state_slots, name="recurrent state blocks") if self.uses_state_blocks else None
    self._state_tables: dict[str, list[int]] = {}  # request -> state block per mamba_block_size tokens (0: none)
    self._hashes: dict[str, list[bytes]] = {}  # request -> chained hashes of its full hash blocks
    self._num_registered: dict[str, dict[int, int]] = {}  # request -> group -> leading blocks registered
    logger.info(
        "KV-cache groups: %s; %d blocks; physical order (%s): %s",
        "; ".join(f"{g.describe()}: {', '.join(g.layer_names)}" for g in self.groups),
        self.num_blocks,
        cfg.kv_cache_layout,
        ", ".join("+".join(names) for names in self.slot_owners),
    )

  @property
  def block_bytes(self) -> int:
    """Bytes of one block id over every attention array (and its state block under the align scheme)."""
    per_block = sum(self._specs[names[0]].page_size_bytes() for names in self.slot_owners if self._is_attention(names))
    if self.uses_state_blocks:
      per_block += self._recurrent_slot_bytes()
    return per_block

  def _is_attention(self, owners: Sequence[str]) -> bool:
    return self._kinds[owners[0]] == ATTENTION

  def _recurrent_slot_bytes(self) -> int:
    """Bytes of one state slot over every recurrent array."""
    return sum(self._specs[names[0]].slot_size_bytes() for names in self.slot_owners if not self._is_attention(names))

  def _pool_num_blocks(self, cfg: Any) -> int:
    """The pool's blocks: `num_kv_blocks`, else what `kv_cache_memory_bytes` holds (see the module docstring)."""
    explicit = int(cfg.num_kv_blocks)
    memory = int(cfg.kv_cache_memory_bytes)
    if explicit > 0:
      return explicit
    per_block = self.block_bytes
    if memory <= 0 or per_block == 0:
      return DEFAULT_NUM_KV_BLOCKS * max(1, len(self.attention_group_ids))
    fixed = 0 if self.uses_state_blocks else self._recurrent_slot_bytes() * (max_num_reqs(cfg) + 1)
    num_blocks = (memory - fixed) // per_block
    if num_blocks < 2:
      raise ValueError(
          f"kv_cache_memory_bytes={memory} holds {max(num_blocks, 0)} blocks of {per_block} bytes (after {fixed}"
          f" bytes of recurrent state slots), but the pool needs at least 2 (block 0 is reserved); raise it"
      )
    return int(num_blocks)

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
    names = [hybrid_cache_utils.layer_name(i) for i in range(self.num_layers)]
    owners = [name for name in names if name in self._specs]
    self._plans = plan_groups(owners, self._specs, self._kinds, hybrid_kv_cache)
    readers: dict[str, list[str]] = {}
    for name in names:
      if name in self._shared:
        readers.setdefault(self._shared[name], []).append(name)
    groups = []
    for group_id, plan in enumerate(self._plans):
      layers = sorted(plan.layer_names + sum((tuple(readers.get(n, ())) for n in plan.layer_names), ()), key=_layer_index)
      first = self._specs[plan.layer_names[0]]
      if plan.kind == RECURRENT:
        groups.append(KVCacheGroup(group_id, RECURRENT, tuple(layers), first, None, None))
        continue
      for name in plan.layer_names:
        block_size = self._specs[name].block_size
        if block_size != first.block_size:
          raise ValueError(
              f"hybrid_kv_cache=False puts every attention layer in one KV-cache group, which needs one block size:"
              f" {plan.layer_names[0]} has block_size {first.block_size} but {name} has {block_size}"
          )
      window = first.sliding_window if hybrid_kv_cache and first.sliding_window else None
      groups.append(KVCacheGroup(group_id, ATTENTION, tuple(layers), first, int(first.block_size), window))
    return tuple(groups)

  # ------------------------------------------------------------------ physical caches
  @property
  def recurrent_slot_indices(self) -> tuple[int, ...]:
    """Indices of the physical list that hold recurrent state tuples (their rows are state slots)."""
    return tuple(i for i, owners in enumerate(self.slot_owners) if not self._is_attention(owners))

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
      num_blocks: blocks per attention cache array (default: the pool's).
    """
    num_blocks = self._check_num_blocks(num_blocks)
    described = []
    for slot, owners in enumerate(self.slot_owners):
      spec = self._specs[owners[0]]
      readers = [name for name, source in self._shared.items() if source in owners]
      users = tuple(owners) + tuple(sorted(readers, key=_layer_index))
      if self._is_attention(owners):
        shapes = (tuple(spec.cache_shape(num_blocks)),)
        dtypes = (str(spec.dtype),)
        nbytes = int(spec.page_size_bytes()) * num_blocks
      else:
        shapes = tuple(tuple(s) for s in spec.cache_shapes(self.num_state_slots))
        dtypes = tuple(str(d) for d in spec.state_dtypes)
        nbytes = int(spec.slot_size_bytes()) * self.num_state_slots
      kind = self._kinds[owners[0]]
      group_ids = tuple(self._group_of_layer[name] for name in owners)
      described.append(CacheSlot(slot, kind, users, group_ids, spec, shapes, dtypes, nbytes))
    return tuple(described)

  def format_layout(self, num_blocks: int | None = None) -> str:
    """A human-readable table of the physical cache list and the groups."""
    lines = [
        f"kv_cache_layout={self.cfg.kv_cache_layout} hybrid_kv_cache={bool(self.cfg.hybrid_kv_cache)}"
        f" num_blocks={self._check_num_blocks(num_blocks)} (one pool for every attention group)"
    ]
    for group in self.groups:
      lines.append(f"{group.describe()}: {', '.join(group.layer_names)}")
    total = 0
    for entry in self.describe_slots(num_blocks):
      arrays = " + ".join(f"{shape} {dtype}" for shape, dtype in zip(entry.shapes, entry.dtypes))
      groups = ", ".join(str(g) for g in entry.group_ids)
      lines.append(
          f"kv_caches[{entry.slot}]: {', '.join(entry.layer_names)} {entry.kind} group{'s' * (len(entry.group_ids) > 1)}"
          f" {groups}: {arrays} = {entry.nbytes} bytes"
      )
      total += entry.nbytes
    lines.append(f"total: {total} bytes")
    return "\n".join(lines)

  def allocate_caches(self, num_blocks: int | None = None) -> list[Any]:
    """Zero-filled physical caches in the runner's shapes and dtypes, in physical order (`cache_shapes`).

    Args:
      num_blocks: blocks per attention array (default: the pool's; must be at least that, or block ids the pool
        hands out would fall outside the arrays).
    """
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.cache_shapes(num_blocks))

  def cache_shapes(self, num_blocks: int | None = None) -> list[Any]:
    """The physical caches' shapes and dtypes (`jax.ShapeDtypeStruct`s), in physical order, without memory.

    Attention entry: one `spec.cache_shape(num_blocks)`; recurrent entry: a tuple `spec.cache_shapes(M)` in
    `spec.state_dtypes` (Gated DeltaNet: conv `[M, K-1, conv_dim]`, recurrent `[M, nv, dk, dv]`).

    Args:
      num_blocks: as for `allocate_caches`.
    """
    num_blocks = self._check_num_blocks(num_blocks)
    shapes: list[Any] = []
    for owners in self.slot_owners:
      spec = self._specs[owners[0]]
      if not self._is_attention(owners):
        states = spec.cache_shapes(self.num_state_slots)
        shapes.append(tuple(jax.ShapeDtypeStruct(s, d) for s, d in zip(states, spec.state_dtypes)))
      else:
        shapes.append(jax.ShapeDtypeStruct(spec.cache_shape(num_blocks), spec.dtype))
    return shapes

  def _check_num_blocks(self, num_blocks: int | None) -> int:
    if num_blocks is None:
      return self.num_blocks
    if num_blocks < self.num_blocks:
      raise ValueError(
          f"num_blocks={num_blocks} is smaller than the block pool ({self.num_blocks} blocks); block ids"
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
    total = num_computed_tokens + num_new_tokens
    known = request_id in self._tables
    allocated = self._allocated_before(request_id, num_computed_tokens, num_new_tokens, prefix_hit)
    if known:
      self._free_out_of_window(request_id, num_computed_tokens)
      self._free_stale_states(request_id, num_computed_tokens)
      tables = self._tables[request_id]
    else:
      tables = {gid: list(prefix_hit.blocks[gid]) if prefix_hit else [] for gid in self.attention_group_ids}
    needed = {gid: max(0, cdiv(total, self.groups[gid].block_size) - len(tables[gid])) for gid in tables}
    # The cached blocks a hit takes back (the free ones among them count against the free blocks).
    taken = {gid: [b for b in tables[gid] if b != NULL_BLOCK] if prefix_hit else [] for gid in tables}
    state_taken = [prefix_hit.state_block] if prefix_hit is not None and prefix_hit.state_block is not None else []
    if not self._blocks_fit(request_id, needed, taken):
      return False
    state_table, write_col = self._state_table_plan(request_id, total, prefix_hit, state_taken)
    if write_col == _NO_ROOM:
      return False
    needs_slot = self._slot_pool is not None and request_id not in self._state_slots
    if needs_slot and self._slot_pool.num_free == 0:
      logger.debug("request %s: no free state slot", request_id)
      return False
    for gid, blocks in taken.items():
      self._pool.take(blocks)
    for gid, n in needed.items():
      tables[gid].extend(self._pool.allocate(n))
    if state_table is not None:
      self._commit_state_table(request_id, state_table, state_taken, write_col)
    if needs_slot:
      self._state_slots[request_id] = self._slot_pool.acquire()
    if not known and self.enable_prefix_caching:
      self._start_registration(request_id, tables, prefix_hit)
    self._tables[request_id] = tables
    self._num_allocated_tokens[request_id] = max(allocated, total)
    return True

  def _start_registration(self, request_id: str, tables: dict[int, list[int]], prefix_hit: PrefixHit | None) -> None:
    """A new request's registered blocks under prefix caching: those of its hit (registered already), else none."""
    hit_tokens = prefix_hit.num_tokens if prefix_hit is not None else 0
    self._num_registered[request_id] = {gid: hit_tokens // self.groups[gid].block_size for gid in tables}

  def _blocks_fit(self, request_id: str, needed: dict[int, int], taken: dict[int, list[int]]) -> bool:
    """Whether the pool has the `needed` new blocks besides the free ones among the cached blocks `taken` back."""
    reviving = sum(1 for blocks in taken.values() for b in blocks if self._pool.refcount(b) == 0)
    if sum(needed.values()) + reviving > self._pool.num_free:
      logger.debug("request %s: %d free blocks, needs %d", request_id, self._pool.num_free, sum(needed.values()))
      return False
    return True

  def _commit_state_table(self, request_id: str, state_table: list[int], state_taken: list[int], write_col: int) -> None:
    """Takes the hit's state block back and gives column `write_col` a state block if it has none."""
    self._state_pool.take(state_taken)
    state_table.extend([NULL_BLOCK] * (write_col + 1 - len(state_table)))
    if state_table[write_col] == NULL_BLOCK:
      state_table[write_col] = self._state_pool.allocate(1)[0]
    self._state_tables[request_id] = state_table

  def _allocated_before(
      self, request_id: str, num_computed_tokens: int, num_new_tokens: int, prefix_hit: PrefixHit | None
  ) -> int:
    """Checks `allocate_slots`' arguments; returns the tokens the request's blocks already cover (a prefix hit's
    for a request not yet holding blocks). Raises ValueError as `allocate_slots` says."""
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
    return allocated

  def _state_table_plan(
      self, request_id: str, total: int, prefix_hit: PrefixHit | None, state_taken: list[int]
  ) -> tuple[list[int] | None, int]:
    """Under prefix caching of recurrent states: the request's state table and the column its last new token
    writes (`total` tokens); (None, -1) without state blocks, (None, `_NO_ROOM`) when no state block is free."""
    if not self.uses_state_blocks:
      return None, -1
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
      return None, _NO_ROOM
    return state_table, write_col

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
    for gid in self.attention_group_ids:
      group = self.groups[gid]
      count = limit * size // group.block_size
      first = prefix_cache.first_window_block(count * group.block_size, group.block_size, group.sliding_window)
      blocks[gid] = tuple(NULL_BLOCK if j < first else self._pool.lookup((gid, hashes[j])) for j in range(count))
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
    lookup = functools.partial(self._lookup, group.group_id)
    return prefix_cache.attention_hit(lookup, hashes, limit, group.block_size, group.sliding_window)

  def _lookup(self, group_id: int, block_hash: bytes) -> int | None:
    """The pool's block registered for `block_hash` in a group (groups never share cached blocks)."""
    return self._pool.lookup((group_id, block_hash))

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
          self._pool.cache_block(table[j], (gid, hashes[j]))
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
        self._pool.free(dead)
        table[:num_dead] = [NULL_BLOCK] * num_dead

  def free(self, request_id: str) -> None:
    """Returns every block of the request in every group, and its state slot (recorded for zeroing) or state
    blocks. Blocks are freed last first, so cached prefix blocks are evicted after the blocks that follow them.

    Raises:
      ValueError: the request holds nothing (never allocated, or already freed).
    """
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    for table in self._tables.pop(request_id).values():
      self._pool.free([b for b in reversed(table) if b != NULL_BLOCK])
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

  def num_free_blocks(self) -> int:
    """Free blocks of the pool every attention group draws from."""
    return self._pool.num_free

  def num_used_blocks(self, group_id: int) -> int:
    """Blocks the block tables of an attention group hold now (blocks shared by requests counted once).

    Raises:
      ValueError: the group is out of range or holds no blocks.
    """
    group = self._group(group_id)
    if group.kind != ATTENTION:
      raise ValueError(f"{group.describe()} holds no blocks")
    return len({b for tables in self._tables.values() for b in tables[group_id] if b != NULL_BLOCK})

  @property
  def peak_used_blocks(self) -> int:
    """The most blocks of the pool in use at once so far."""
    return self._pool.peak_used

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
    full = [g for g in self.groups if g.kind == ATTENTION and not g.sliding_window]
    needed = sum(cdiv(num_tokens, g.block_size) for g in full)
    if needed > self.num_blocks - 1:
      raise ValueError(
          f"request {request_id!r}: {num_tokens} tokens need {needed} blocks in"
          f" {', '.join(g.describe() for g in full)}, but the pool has {self.num_blocks - 1} (block 0 is reserved);"
          " raise kv_cache_memory_bytes or num_kv_blocks"
      )

  def blocks_to_grow(self, request_id: str, num_tokens: int, prefix_hit: PrefixHit | None = None) -> int:
    """Free blocks a request may still take from the pool until its cache holds `num_tokens` tokens (the scheduler's
    `admission_reserve=max_tokens`).

    A group that keeps every block needs `cdiv(num_tokens, block_size)` blocks; a sliding-window group at most
    the blocks one window spans, `cdiv(W - 1, block_size) + 1` (what a decode holds; a prefill chunk holds more
    for one step: `window_spill_blocks`); recurrent groups hold no blocks. Blocks the request holds count as held;
    a request holding none counts its prefix hit's blocks that other requests hold (the free cached ones it would
    take back come out of the free blocks too).
    """
    tables = self._tables.get(request_id)
    total = 0
    for gid in self.attention_group_ids:
      group = self.groups[gid]
      target = cdiv(num_tokens, group.block_size)
      if group.sliding_window:
        target = min(target, cdiv(group.sliding_window - 1, group.block_size) + 1)
      if tables is not None:
        held = sum(1 for b in tables[gid] if b != NULL_BLOCK)
      elif prefix_hit is not None:
        held = sum(1 for b in prefix_hit.blocks[gid] if b != NULL_BLOCK and self._pool.refcount(b) > 0)
      else:
        held = 0
      total += max(0, target - held)
    return total

  def window_spill_blocks(self, num_tokens: int, num_requests: int) -> int:
    """The most blocks sliding-window groups hold beyond `blocks_to_grow`'s window in one step of `num_tokens`
    tokens over `num_requests` requests: a chunk of n tokens reaches at most `cdiv(n, block_size)` blocks past
    its window, so per group `cdiv(num_tokens, block_size) + num_requests` in all (0 without sliding windows)."""
    return sum(
        cdiv(num_tokens, self.groups[gid].block_size) + num_requests
        for gid in self.attention_group_ids
        if self.groups[gid].sliding_window
    )

  def _request_tables(self, request_id: str) -> dict[int, list[int]]:
    if request_id not in self._tables:
      raise ValueError(f"request {request_id!r} holds no blocks (never allocated, or already freed)")
    return self._tables[request_id]

  def _group(self, group_id: int) -> KVCacheGroup:
    if not 0 <= group_id < len(self.groups):
      raise ValueError(f"group_id {group_id} is out of range: there are {len(self.groups)} KV-cache groups")
    return self.groups[group_id]
