"""Backs the weights of a CPU model with 2 MiB pages (Linux transparent huge pages), where the kernel allows.

A decode step on the CPU reads every weight once, front to back, so its speed is the memory's read bandwidth. With
4 KiB pages a stream through 150 MB of weights misses the TLB once per page, about 37,000 times per step, and each
miss walks the page tables (two levels of them in a virtual machine). With 2 MiB pages that is 512 times fewer
misses. XLA allocates its buffers with `malloc`, so they land on 4 KiB pages unless the system backs every
allocation with huge pages (`/sys/kernel/mm/transparent_hugepage/enabled` = `always`; the common default,
`madvise`, only backs memory a program asks for).

`collapse(ranges)` asks for them after the fact: `madvise(MADV_COLLAPSE)` (Linux 6.1+) copies the pages of a
2 MiB-aligned region into one huge page, in place, and keeps the contents; the program notices nothing but the
speed. Every region a buffer touches is collapsed, so the first and last may take in bytes of the buffers beside
it: they belong to the same process and keep their contents too, but a region the process had only partly
touched costs up to 2 MiB more memory (its untouched pages are filled). A region that does not lie inside one
private anonymous mapping is skipped (the kernel would refuse it). The engine does this once, in a thread, after
its first step (`huge_page_weights`); a refusal is only logged, as the pages are an optimisation, never a
requirement.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import functools
import logging
import platform
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes of an x86-64 (and arm64 4 KiB-granule) transparent huge page
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _libc() -> ctypes.CDLL:
  libc = ctypes.CDLL(None, use_errno=True)
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  libc.madvise.restype = ctypes.c_int
  return libc


def unsupported_reason(system: str | None = None, release: str | None = None) -> str | None:
  """Why huge pages cannot be asked for here (None when they can): Linux 6.1 or later, with transparent huge
  pages not turned off by the administrator."""
  system = system or platform.system()
  if system != "Linux":
    return f"transparent huge pages are a Linux feature; this system is {system}"
  release = release or platform.release()
  version = tuple(int(part) for part in re.findall(r"\d+", release)[:2])
  if version < (6, 1):
    return f"MADV_COLLAPSE needs Linux 6.1 or later; this kernel is {release}"
  try:
    setting = THP_SETTING.read_text(encoding="utf-8")
  except OSError as e:
    return f"this kernel has no transparent huge pages ({e.strerror}: {THP_SETTING})"
  if "[never]" in setting:
    return f"transparent huge pages are off ({THP_SETTING} is 'never')"
  return None


def buffer_ranges(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
  """(address, bytes) of every CPU buffer that holds `arrays` (each shard of a sharded array); others are skipped.

  Raises:
    ValueError: an element is not a JAX array, or its buffer was deleted (named by its position).
  """
  ranges = []
  for i, array in enumerate(arrays):
    if not isinstance(array, jax.Array):
      raise ValueError(f"huge_pages.buffer_ranges: arrays[{i}] must be a jax.Array, got {type(array).__name__}")
    if array.is_deleted():
      raise ValueError(f"huge_pages.buffer_ranges: arrays[{i}] (shape {array.shape}) was deleted")
    for shard in array.addressable_shards:
      if shard.device.platform == "cpu" and shard.data.nbytes > 0:
        ranges.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
  return ranges


def _madvise_collapse(start: int, end: int) -> int:
  """0 when [start, end) (2 MiB-aligned) now lies on huge pages, else the errno."""
  if _libc().madvise(start, end - start, MADV_COLLAPSE) == 0:
    return 0
  return ctypes.get_errno()


def private_mappings(maps: str | None = None) -> list[tuple[int, int]]:
  """(start, end) of the process's private, writable, anonymous mappings (those MADV_COLLAPSE takes), sorted;
  `maps` is the text of /proc/self/maps (read when None)."""
  if maps is None:
    maps = Path("/proc/self/maps").read_text(encoding="utf-8")
  spans = []
  for line in maps.splitlines():
    fields = line.split()
    if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p" or fields[4] != "0":
      continue
    if len(fields) > 5 and fields[5] != "[heap]":  # [stack], [vvar], ...
      continue
    low, high = (int(v, 16) for v in fields[0].split("-"))
    spans.append((low, high))
  return sorted(spans)


def collapse(ranges: Sequence[tuple[int, int]], *, attempts: int = 4, retry_delay_s: float = 1e-3) -> int:
  """Backs each (address, bytes) range with huge pages where the kernel can; returns the bytes of the ranges that
  now lie on them.

  Every 2 MiB region a range touches is collapsed on its own, once however many ranges share it, and only when it
  lies wholly inside one private anonymous mapping (`private_mappings`; the first and last region of a buffer may
  reach past it). A region the kernel refuses is tried again up to `attempts` times in all, `retry_delay_s` apart:
  memory written moments before can be refused for a while (EAGAIN, or EINVAL while its pages wait to join the
  kernel's page lists). Refusals are logged at debug level; on a system that cannot (`unsupported_reason`), the
  reason is logged at info level and nothing is tried.

  Raises:
    ValueError: a range has a negative address or size (named by its position), or attempts < 1.
  """
  for i, (address, size) in enumerate(ranges):
    if address < 0 or size < 0:
      raise ValueError(f"huge_pages.collapse: ranges[{i}] must be a non-negative (address, bytes), got {(address, size)}")
  if attempts < 1:
    raise ValueError(f"huge_pages.collapse: attempts must be at least 1, got {attempts}")
  reason = unsupported_reason()
  if reason is not None:
    logger.info("weights stay on 4 KiB pages: %s", reason)
    return 0
  spans = private_mappings()
  starts = [low for low, _ in spans]
  done: dict[int, bool] = {}  # region start -> whether it lies on a huge page now

  def collapsed(region: int) -> bool:
    i = bisect.bisect_right(starts, region) - 1
    if i < 0 or spans[i][1] < region + HUGE_PAGE:
      return False  # not inside one mapping: the kernel would refuse it
    for attempt in range(attempts):
      error = _madvise_collapse(region, region + HUGE_PAGE)
      if error == 0:
        return True
      logger.debug("MADV_COLLAPSE of %#x (attempt %d) failed: %s", region, attempt + 1, errno.errorcode.get(error, error))
      if attempt + 1 < attempts:
        time.sleep(retry_delay_s)
    return False

  covered = 0
  for address, size in ranges:
    end = address + size
    for region in range(address // HUGE_PAGE * HUGE_PAGE, end, HUGE_PAGE):
      if region not in done:
        done[region] = collapsed(region)
      if done[region]:
        covered += min(end, region + HUGE_PAGE) - max(address, region)
  return covered
