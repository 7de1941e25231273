"""Checks of the KV-cache manager's bookkeeping that tests run after every step (the runtime never calls them).

They read the manager's private tables and pools on purpose: what they check is that the bookkeeping the runtime
keeps agrees with itself, which no public method can show without keeping a second copy of it.
"""

# pylint: disable=protected-access  # a test-only checker of KVCacheManager's private bookkeeping (see above)

from __future__ import annotations

from collections.abc import Collection, Iterable

from maxtext.inference.block_pool import NULL_BLOCK, BlockPool
from maxtext.inference.kv_cache_manager import KVCacheManager


def all_free(manager: KVCacheManager) -> bool:
  """Leak check: no request holds anything and every block, state slot and state block is free (cached blocks no
  request holds count as free: they are evicted on demand)."""
  slots_free = manager._slot_pool is None or manager._slot_pool.num_used == 0
  state_pool = manager._state_pool
  states_free = state_pool is None or (state_pool.num_used == 0 and not manager._state_tables)
  return not manager._tables and slots_free and states_free and manager._pool.num_used == 0


def check_consistency(manager: KVCacheManager, live_request_ids: Collection[str]) -> None:
  """Checks the allocation bookkeeping against the requests that should hold caches.

  Holds when: exactly `live_request_ids` hold tables; every block a table names has a reference count equal to
  the number of table entries naming it, and every other block is free (or free and cached); no block is in the
  tables of two groups (their layers may share an array, so one would overwrite the other); the same for the
  state blocks of prefix caching; no state slot is held by two requests, and the slot pool's used slots are
  exactly the requests' slots.

  Raises:
    AssertionError: naming the first broken invariant (a leak, a double reference or a shared slot).
  """
  holders = set(manager._tables)
  if holders != set(live_request_ids):
    raise AssertionError(
        f"requests holding caches {sorted(holders)} differ from the live requests {sorted(live_request_ids)}"
    )
  group_of_block: dict[int, int] = {}
  for request_tables in manager._tables.values():
    for gid, table in request_tables.items():
      for block in table:
        if block != NULL_BLOCK and group_of_block.setdefault(block, gid) != gid:
          raise AssertionError(f"block {block} is in the tables of groups {group_of_block[block]} and {gid}")
  tables = (table for request_tables in manager._tables.values() for table in request_tables.values())
  _check_refcounts(manager._pool, tables, "block", "block-table entries")
  state_pool = manager._state_pool
  if state_pool is not None:
    if set(manager._state_tables) != holders:
      raise AssertionError(f"requests with state tables {sorted(manager._state_tables)} differ from {sorted(holders)}")
    _check_refcounts(state_pool, manager._state_tables.values(), f"{state_pool.name}: state block", "state-table entries")
  slots = list(manager._state_slots.values())
  if len(set(slots)) != len(slots):
    raise AssertionError(f"a state slot is held by two requests: {manager._state_slots}")
  slot_pool = manager._slot_pool
  used = 0 if slot_pool is None else slot_pool.num_used
  if used != len(slots) or (slot_pool is not None and set(manager._state_slots) != holders):
    raise AssertionError(f"{used} state slots are in use but requests hold {sorted(slots)}")


def _check_refcounts(pool: BlockPool, tables: Iterable[list[int]], what: str, entries: str) -> None:
  """Every block of `pool` has a reference count equal to the number of `tables` entries naming it."""
  counts: dict[int, int] = {}
  for table in tables:
    for block in table:
      if block != NULL_BLOCK:
        counts[block] = counts.get(block, 0) + 1
  for block in range(1, pool.num_blocks):
    if pool.refcount(block) != counts.get(block, 0):
      raise AssertionError(
          f"{what} {block} has reference count {pool.refcount(block)} but {counts.get(block, 0)} {entries}"
      )
