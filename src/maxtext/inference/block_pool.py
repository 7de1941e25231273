"""A reference-counted pool of attention cache blocks (one pool per KV-cache group).

Block 0 is the null block: it is never handed out, and block-table entries that point at no block (padding, or
blocks a sliding-window group has released) hold 0. Allocation is deterministic: the lowest free ids first.

Contract: `allocate(n)` either returns `n` blocks or raises `OutOfBlocksError` without changing the pool, so a
caller that must not fail checks `num_free` first (the KV-cache manager does, for all groups at once).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable

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
    self._num_free = num_blocks - 1

  @property
  def num_free(self) -> int:
    """Blocks that can be allocated now."""
    return self._num_free

  @property
  def num_used(self) -> int:
    """Blocks with a reference count above zero (the null block is never counted)."""
    return self.num_blocks - 1 - self._num_free

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
    if n > self._num_free:
      raise OutOfBlocksError(
          f"{self.name}: {n} blocks requested but only {self._num_free} of {self.num_blocks - 1} are free"
      )
    blocks = [heapq.heappop(self._free) for _ in range(n)]
    for block in blocks:
      self._refcounts[block] = 1
    self._num_free -= n
    return blocks

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
        heapq.heappush(self._free, block)
        self._num_free += 1

  def _check_id(self, block: int) -> None:
    if block == NULL_BLOCK:
      raise ValueError(f"{self.name}: block 0 is the reserved null block; it is never allocated, referenced or freed")
    if not 0 < block < self.num_blocks:
      raise ValueError(f"{self.name}: block {block} is out of range [1, {self.num_blocks})")
