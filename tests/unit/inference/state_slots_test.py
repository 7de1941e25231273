"""Tests of the recurrent-state slot pool."""

import pytest

from maxtext.inference.state_slots import OutOfStateSlotsError, StateSlotPool


def test_lowest_free_slot_first_and_released_slots_are_reported_for_zeroing():
  pool = StateSlotPool(5)
  assert [pool.acquire() for _ in range(3)] == [1, 2, 3]
  assert (pool.num_free, pool.num_used) == (1, 3)
  assert pool.release(2) == 2
  assert pool.release(1) == 1
  assert pool.acquire() == 1
  assert pool.drain_slots_to_zero() == [2, 1]
  assert not pool.drain_slots_to_zero()
  pool.release(1)
  pool.acquire()
  pool.release(1)
  assert pool.drain_slots_to_zero() == [1]  # recorded once until drained


def test_exhaustion_raises():
  pool = StateSlotPool(3)
  pool.acquire()
  pool.acquire()
  with pytest.raises(OutOfStateSlotsError, match="all 2 recurrent state slots are in use"):
    pool.acquire()


@pytest.mark.parametrize(
    "slot, match",
    [(0, "slot 0 is the reserved null slot"), (7, r"out of range \[1, 3\)"), (2, "slot 2 is not in use")],
)
def test_bad_release(slot, match):
  pool = StateSlotPool(3)
  pool.acquire()
  with pytest.raises(ValueError, match=match):
    pool.release(slot)
  assert pool.num_used == 1 and not pool.drain_slots_to_zero()


def test_constructor_errors():
  with pytest.raises(ValueError, match="num_state_slots must be >= 2"):
    StateSlotPool(1)
  with pytest.raises(TypeError, match="num_state_slots must be an int"):
    StateSlotPool("4")
