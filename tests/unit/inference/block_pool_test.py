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
