"""Tests of the reference-counted block pool."""

import pytest

from maxtext.inference.block_pool import BlockPool, OutOfBlocksError


def test_allocates_lowest_ids_first_and_never_the_null_block():
  pool = BlockPool(6)
  assert (pool.num_free, pool.num_used) == (5, 0)
  assert pool.allocate(2) == [1, 2]
  assert pool.allocate(3) == [3, 4, 5]
  assert (pool.num_free, pool.num_used) == (0, 5)
  assert pool.allocate(0) == []


def test_freed_blocks_are_reused_lowest_first():
  pool = BlockPool(8)
  pool.allocate(5)
  pool.free([4, 2])
  assert pool.num_free == 4
  assert pool.allocate(3) == [2, 4, 6]


def test_reference_counting():
  pool = BlockPool(4)
  (block,) = pool.allocate(1)
  pool.incref([block])
  assert pool.refcount(block) == 2
  pool.free([block])
  assert pool.refcount(block) == 1 and pool.num_free == 2
  pool.free([block])
  assert pool.refcount(block) == 0 and pool.num_free == 3


def test_allocate_more_than_free_raises_and_leaves_pool_unchanged():
  pool = BlockPool(4)
  pool.allocate(2)
  with pytest.raises(OutOfBlocksError, match="3 blocks requested but only 1 of 3 are free"):
    pool.allocate(3)
  assert pool.num_free == 1
  assert pool.allocate(1) == [3]


@pytest.mark.parametrize(
    "blocks, match",
    [
        ([0], "block 0 is the reserved null block"),
        ([9], r"block 9 is out of range \[1, 4\)"),
        ([2], "block 2 is already free"),
        ([1, 1], "block 1 is freed 2 times but has only 1 references"),
    ],
)
def test_bad_free_names_the_block_and_changes_nothing(blocks, match):
  pool = BlockPool(4, name="group 1")
  pool.allocate(1)
  with pytest.raises(ValueError, match="group 1: " + match):
    pool.free(blocks)
  assert pool.refcount(1) == 1 and pool.num_free == 2


def test_incref_of_a_free_or_null_block_raises():
  pool = BlockPool(4)
  pool.allocate(1)
  with pytest.raises(ValueError, match="cannot add a reference to block 2: it is free"):
    pool.incref([1, 2])
  assert pool.refcount(1) == 1
  with pytest.raises(ValueError, match="null block"):
    pool.incref([0])


def test_constructor_and_argument_errors():
  with pytest.raises(ValueError, match="num_blocks must be >= 2"):
    BlockPool(1)
  with pytest.raises(TypeError, match="num_blocks must be an int, got float"):
    BlockPool(4.0)
  with pytest.raises(TypeError, match="got bool"):
    BlockPool(True)
  with pytest.raises(ValueError, match="negative number of blocks"):
    BlockPool(4).allocate(-1)
  with pytest.raises(ValueError, match="null block"):
    BlockPool(4).refcount(0)


def test_cached_blocks_stay_findable_when_free_and_are_evicted_least_recently_freed_first():
  pool = BlockPool(6)
  blocks = pool.allocate(4)  # 1, 2, 3, 4
  for block, key in zip(blocks, "abcd"):
    assert pool.cache_block(block, key)
  pool.free([3, 1])  # 3 freed before 1
  pool.free([4])  # freed last; 2 is still in use
  # Four blocks free (5, never cached, and the cached 1, 3, 4); all four registered blocks stay findable.
  assert pool.num_free == 4 and [pool.refcount(b) for b in (1, 2, 3, 4)] == [0, 1, 0, 0]
  assert [pool.lookup(key) for key in "abcd"] == [1, 2, 3, 4]
  assert pool.lookup("a") == 1 and pool.lookup("z") is None and pool.block_hash(1) == "a"
  # A hit takes a free cached block back; it is no longer evictable.
  pool.take([1])
  assert pool.refcount(1) == 1 and pool.num_free == 3
  # Allocation uses never-cached block 5 first, then evicts 3 (freed first), then 4.
  assert pool.allocate(1) == [5]
  assert pool.allocate(2) == [3, 4]
  assert pool.lookup("c") is None and pool.lookup("d") is None
  assert pool.block_hash(3) is None


def test_cache_block_keeps_the_first_block_of_a_hash_and_rejects_free_blocks():
  pool = BlockPool(4)
  first, second = pool.allocate(2)
  assert pool.cache_block(first, "h") and not pool.cache_block(second, "h") and not pool.cache_block(first, "g")
  pool.free([second])
  assert (
      pool.block_hash(second) is None and pool.lookup("h") == first and pool.num_free == 2
  )  # the duplicate stayed private
  with pytest.raises(ValueError, match="cannot cache block 2: it is free"):
    pool.cache_block(second, "x")
  with pytest.raises(ValueError, match="block 2 holds no cached tokens"):
    pool.take([second])
