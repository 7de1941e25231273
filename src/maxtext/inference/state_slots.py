"""The pool of recurrent-state slots (rows of every GDN conv / recurrent state array).

Lifecycle, as in the upstream runner: slot 0 is the null slot (padding requests point at it); a request takes the
lowest free slot when it is admitted and keeps it while it lives, also in steps where it is not scheduled; a
request that finishes, or is preempted and will be recomputed from scratch, releases it. A released slot is
recorded for zeroing: the engine drains `drain_slots_to_zero()` before the next model step and writes zeros into
those rows of every recurrent cache, so no stale state can leak into a later request.
"""

from __future__ import annotations

import heapq

NULL_SLOT = 0


class OutOfStateSlotsError(RuntimeError):
  """Every recurrent-state slot is taken."""


class StateSlotPool:
  """Slots `1 .. num_slots-1` handed out lowest first (slot 0 is the null slot).

  Args:
    num_slots: rows of the recurrent state arrays, including the null slot 0 (M in `(M, K-1, conv_dim)`).
  """

  def __init__(self, num_slots: int):
    if isinstance(num_slots, bool) or not isinstance(num_slots, int):
      raise TypeError(f"num_state_slots must be an int, got {type(num_slots).__name__}")
    if num_slots < 2:
      raise ValueError(f"num_state_slots must be >= 2 (slot 0 is the reserved null slot), got {num_slots}")
    self.num_slots = num_slots
    self._free = list(range(1, num_slots))  # a min-heap
    self._used: set[int] = set()
    self._to_zero: list[int] = []

  @property
  def num_free(self) -> int:
    """Slots that can be acquired now."""
    return len(self._free)

  @property
  def num_used(self) -> int:
    """Slots held by requests."""
    return len(self._used)

  def acquire(self) -> int:
    """Takes the lowest free slot.

    Raises:
      OutOfStateSlotsError: every slot is held.
    """
    if not self._free:
      raise OutOfStateSlotsError(f"all {self.num_slots - 1} recurrent state slots are in use")
    slot = heapq.heappop(self._free)
    self._used.add(slot)
    return slot

  def release(self, slot: int) -> int:
    """Returns `slot` to the pool and records it for zeroing; returns the slot.

    Raises:
      ValueError: the slot is the null slot, out of range, or not held.
    """
    if slot == NULL_SLOT:
      raise ValueError("state slot 0 is the reserved null slot; it is never acquired or released")
    if not 0 < slot < self.num_slots:
      raise ValueError(f"state slot {slot} is out of range [1, {self.num_slots})")
    if slot not in self._used:
      raise ValueError(f"state slot {slot} is not in use (released twice?)")
    self._used.remove(slot)
    heapq.heappush(self._free, slot)
    if slot not in self._to_zero:
      self._to_zero.append(slot)
    return slot

  def drain_slots_to_zero(self) -> list[int]:
    """Returns the slots released since the last call (in release order) and clears the record."""
    slots, self._to_zero = self._to_zero, []
    return slots
