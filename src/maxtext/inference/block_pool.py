"""A reference-counted pool of attention cache blocks (one pool that every KV-cache group draws from).

Block 0 is the null block: it is never handed out, and block-table entries that point at no block (padding, or
blocks a sliding-window group has released) hold 0. Allocation is deterministic: the lowest free ids first.

Contract: `allocate(n)` either returns `n` blocks or raises `OutOfBlocksError` without changing the pool, so a
caller that must not fail checks `num_free` first (the KV-cache manager does, for all groups at once).

Prefix caching: a block in use may be registered under the hash of the tokens it holds (`cache_block`). When its
last reference goes, a registered block is not wiped: it stays findable (`lookup`) as a free cached block, and a
hit takes it back (`take`). `allocate` hands out never-cached free blocks first (lowest ids), then evicts free
cached blocks in least-recently-freed order (LRU), dropping their hashes. `num_free` counts both kinds.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Hashable, Iterable

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
  """The pool has fewer free blocks than requested."""


class BlockPool:
  """Reference-counted blocks `1 .. num_blocks-1` (block 0 is the reserved null block).

  Args:
    num_blocks: number of blocks in the cache arrays, including the null block 0 (so `num_blocks - 1` are usable).
    name: shown in error messages (e.g. "group 1 (sliding_attention, window 8)").
  """

  def __init__(self, num_blocks: int, name: str = "block pool"):
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
      raise TypeError(f"{name}: num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks < 2:
      raise ValueError(f"{name}: num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
    self.name = name
    self.num_blocks = num_blocks
    self._refcounts = [0] * num_blocks
    self._free = list(range(1, num_blocks))  # a min-heap: already sorted, so already a heap
    self._num_free = num_blocks - 1  # blocks on the heap (never cached, or evicted)
    self._hash_of: dict[int, Hashable] = {}  # registered block -> its hash
    self._block_of: dict[Hashable, int] = {}  # hash -> registered block
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # free cached, LRU first
    self.peak_used = 0  # the most blocks in use at once

  @property
  def num_free(self) -> int:
    """Blocks that can be allocated now (never-cached free blocks plus free cached ones, which are evicted)."""
    return self._num_free + len(self._evictable)

  @property
  def num_used(self) -> int:
    """Blocks with a reference count above zero (the null block is never counted)."""
    return self.num_blocks - 1 - self.num_free

  def refcount(self, block: int) -> int:
    """The reference count of `block` (0 when free)."""
    self._check_id(block)
    return self._refcounts[block]

  def allocate(self, n: int) -> list[int]:
    """Hands out the `n` lowest free blocks, each with reference count 1.

    Raises:
      ValueError: `n` is negative.
      OutOfBlocksError: fewer than `n` blocks are free; the pool is unchanged.
    """
    if n < 0:
      raise ValueError(f"{self.name}: cannot allocate a negative number of blocks ({n})")
    if n > self.num_free:
      raise OutOfBlocksError(
          f"{self.name}: {n} blocks requested but only {self.num_free} of {self.num_blocks - 1} are free"
      )
    from_heap = min(n, self._num_free)
    blocks = [heapq.heappop(self._free) for _ in range(from_heap)]
    self._num_free -= from_heap
    for _ in range(n - from_heap):
      block, _ = self._evictable.popitem(last=False)
      del self._block_of[self._hash_of.pop(block)]
      blocks.append(block)
    for block in blocks:
      self._refcounts[block] = 1
    self.peak_used = max(self.peak_used, self.num_used)
    return blocks

  def lookup(self, block_hash: Hashable) -> int | None:
    """The block registered under `block_hash` (in use or free cached), or None."""
    return self._block_of.get(block_hash)

  def block_hash(self, block: int) -> Hashable | None:
    """The hash `block` is registered under, or None."""
    self._check_id(block)
    return self._hash_of.get(block)

  def cache_block(self, block: int, block_hash: Hashable) -> bool:
    """Registers an in-use block under the hash of the tokens it holds; returns whether it was registered.

    A block already registered keeps its hash, and a hash another block holds keeps that block (two requests
    computed the same tokens at once: the first one wins, the other block stays private).

    Raises:
      ValueError: the block is the null block, out of range, or free.
    """
    self._check_id(block)
    if self._refcounts[block] == 0:
      raise ValueError(f"{self.name}: cannot cache block {block}: it is free")
    if block in self._hash_of or block_hash in self._block_of:
      return False
    self._hash_of[block] = block_hash
    self._block_of[block_hash] = block
    return True

  def take(self, blocks: Iterable[int]) -> None:
    """Adds a reference to each registered block found by `lookup`, taking free cached ones off the LRU list.

    Raises:
      ValueError: a block is not registered (checked before anything changes).
    """
    blocks = list(blocks)
    for block in blocks:
      self._check_id(block)
      if block not in self._hash_of:
        raise ValueError(f"{self.name}: block {block} holds no cached tokens; only cached blocks can be taken")
    for block in blocks:
      if self._refcounts[block] == 0:
        del self._evictable[block]
      self._refcounts[block] += 1
    self.peak_used = max(self.peak_used, self.num_used)

  def incref(self, blocks: Iterable[int]) -> None:
    """Adds one reference to each block (all must be in use; checked before anything changes).

    Raises:
      ValueError: a block is the null block, out of range, or free.
    """
    blocks = list(blocks)
    for block in blocks:
      self._check_id(block)
      if self._refcounts[block] == 0:
        raise ValueError(f"{self.name}: cannot add a reference to block {block}: it is free")
    for block in blocks:
      self._refcounts[block] += 1

  def free(self, blocks: Iterable[int]) -> None:
    """Drops one reference from each block; a block whose count reaches 0 returns to the free list.

    A registered (cached) block whose count reaches 0 stays findable and joins the end of the LRU list, in the
    order given (so free a request's blocks last block first: its prefix blocks are then evicted last).

    Every block is checked before anything changes, so a bad call leaves the pool as it was.

    Raises:
      ValueError: a block is the null block, out of range, or already free (also when listed more times than it
        has references).
    """
    counts = collections.Counter(blocks)
    for block, times in counts.items():
      self._check_id(block)
      if self._refcounts[block] < times:
        if self._refcounts[block] == 0:
          raise ValueError(f"{self.name}: block {block} is already free")
        raise ValueError(
            f"{self.name}: block {block} is freed {times} times but has only {self._refcounts[block]} references"
        )
    for block, times in counts.items():
      self._refcounts[block] -= times
      if self._refcounts[block] == 0:
        if block in self._hash_of:
          self._evictable[block] = None  # most recently freed: evicted last
        else:
          heapq.heappush(self._free, block)
          self._num_free += 1

  def _check_id(self, block: int) -> None:
    if block == NULL_BLOCK:
      raise ValueError(f"{self.name}: block 0 is the reserved null block; it is never allocated, referenced or freed")
    if not 0 < block < self.num_blocks:
      raise ValueError(f"{self.name}: block {block} is out of range [1, {self.num_blocks})")
