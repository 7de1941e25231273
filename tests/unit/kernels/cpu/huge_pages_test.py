"""Tests for moving CPU buffers onto transparent huge pages: the system checks, the buffers' ranges, MADV_COLLAPSE
(read back from /proc/self/smaps) and its fallback to the regions inside a range."""

import ctypes
import logging
import mmap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels.cpu import huge_pages

needs_huge_pages = pytest.mark.skipif(
    huge_pages.unsupported_reason() is not None, reason=f"{huge_pages.unsupported_reason()}"
)
MB = 1 << 20


def _huge_kb_at(address: int) -> int:
  """AnonHugePages (kB) of the mapping that holds `address`, from /proc/self/smaps."""
  inside = False
  with open("/proc/self/smaps", encoding="utf-8") as f:
    for line in f:
      first = line.split()[0]
      if "-" in first and not first.endswith(":"):
        low, high = (int(v, 16) for v in first.split("-"))
        inside = low <= address < high
      elif inside and first == "AnonHugePages:":
        return int(line.split()[1])
  raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(
    "system, release, setting, reason",
    [
        ("Darwin", "23.1.0", "always [madvise] never", "Linux feature; this system is Darwin"),
        ("Linux", "5.15.0-91-generic", "always [madvise] never", "needs Linux 6.1 or later; this kernel is 5.15.0"),
        ("Linux", "6.1.0-18-amd64", "always madvise [never]", "transparent huge pages are off"),
        ("Linux", "6.1.0-18-amd64", None, "this kernel has no transparent huge pages"),
        ("Linux", "6.1.0-18-amd64", "always [madvise] never", None),
        ("Linux", "6.18.44", "[always] madvise never", None),
    ],
)
def test_unsupported_reason(tmp_path, monkeypatch, system, release, setting, reason):
  path = tmp_path / "enabled"
  if setting is not None:
    path.write_text(setting + "\n")
  monkeypatch.setattr(huge_pages, "THP_SETTING", path)
  got = huge_pages.unsupported_reason(system, release)
  assert got is None if reason is None else reason in got


def test_buffer_ranges_lists_every_cpu_shard():
  x = jnp.arange(1024, dtype=jnp.float32)
  assert huge_pages.buffer_ranges([x]) == [(x.unsafe_buffer_pointer(), 4096)]
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  sharded = jax.device_put(jnp.ones((4, 256), jnp.float32), jax.NamedSharding(mesh, jax.P("data")))
  ranges = huge_pages.buffer_ranges([sharded, x])
  assert [size for _, size in ranges] == [2048, 2048, 4096] and len({address for address, _ in ranges}) == 3


def test_buffer_ranges_names_the_bad_element():
  with pytest.raises(ValueError, match=r"arrays\[1\] must be a jax.Array, got ndarray"):
    huge_pages.buffer_ranges([jnp.ones(2), np.ones(2)])
  gone = jnp.ones((3, 2))
  gone.delete()
  with pytest.raises(ValueError, match=r"arrays\[0\] \(shape \(3, 2\)\) was deleted"):
    huge_pages.buffer_ranges([gone])


def test_collapse_rejects_a_negative_range():
  with pytest.raises(ValueError, match=r"ranges\[1\] must be a non-negative \(address, bytes\), got \(4096, -1\)"):
    huge_pages.collapse([(0, 0), (4096, -1)])


def test_collapse_does_nothing_where_unsupported(monkeypatch, caplog):
  monkeypatch.setattr(huge_pages, "unsupported_reason", lambda: "not here")
  monkeypatch.setattr(huge_pages, "_madvise_collapse", lambda *_: pytest.fail("madvise called"))
  with caplog.at_level(logging.INFO, logger=huge_pages.__name__):
    assert huge_pages.collapse([(1 << 30, 8 * MB)]) == 0
  assert "weights stay on 4 KiB pages: not here" in caplog.text


@needs_huge_pages
def test_collapse_moves_an_array_onto_huge_pages_and_keeps_its_values():
  values = np.random.default_rng(0).standard_normal(3 * MB).astype(np.float32)  # 12 MB
  x = jnp.asarray(values) + 0.0  # a buffer XLA allocated
  address, size = huge_pages.buffer_ranges([x])[0]
  page = huge_pages.HUGE_PAGE
  inside = (address + size) // page * page - -(-address // page) * page  # the whole regions within the buffer
  # Those at least; the first and last region too where they lie inside the buffer's mapping.
  assert inside <= huge_pages.collapse([(address, size)]) <= size
  assert _huge_kb_at(address + size // 2) * 1024 >= inside
  np.testing.assert_array_equal(np.asarray(x), values)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2.0)(x)), values * 2.0)


@needs_huge_pages
def test_collapse_falls_back_to_the_regions_inside_the_range():
  """A range whose widened regions reach unmapped memory collapses the whole regions it holds."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
  raw = libc.mmap(None, 12 * MB, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
  assert raw not in (None, ctypes.c_void_p(-1).value)
  try:
    base = -(-raw // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE  # 2 MiB-aligned, with 8 MB mapped after it
    assert libc.munmap(base, MB) == 0  # the first region now has a hole
    ctypes.memset(base + MB, 7, 7 * MB)
    start = base + MB + MB // 2
    covered = huge_pages.collapse([(start, base + 8 * MB - start)])
    assert covered == 6 * MB  # regions 2-4 (of 0-4): the first reaches the hole
    assert _huge_kb_at(base + 4 * MB) * 1024 >= 6 * MB
    assert ctypes.string_at(base + MB, 7 * MB) == b"\x07" * (7 * MB)
  finally:
    # Only what is still this test's: another thread's mapping may have landed in the hole since.
    if base > raw:
      libc.munmap(raw, base - raw)
    libc.munmap(base + MB, raw + 12 * MB - (base + MB))


def test_private_mappings_keeps_the_private_anonymous_ones():
  maps = "\n".join(
      [
          "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 ",
          "55d000000000-55d000021000 rw-p 00000000 00:00 0                          [heap]",
          "7f0000400000-7f0000600000 r--p 00000000 00:00 0 ",
          "7f0000600000-7f0000800000 rw-s 00000000 00:01 17                         /dev/zero (deleted)",
          "7f0000800000-7f0000a00000 rw-p 00001000 08:01 1234                       /usr/lib/libc.so.6",
          "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]",
          "",
      ]
  )
  assert huge_pages.private_mappings(maps) == [(0x55D000000000, 0x55D000021000), (0x7F0000000000, 0x7F0000400000)]
  assert huge_pages.private_mappings()  # this process has some


def test_collapse_rejects_no_attempts():
  with pytest.raises(ValueError, match="attempts must be at least 1, got 0"):
    huge_pages.collapse([], attempts=0)


def test_collapse_retries_a_refused_region_and_counts_shared_regions_once(monkeypatch):
  page = huge_pages.HUGE_PAGE
  monkeypatch.setattr(huge_pages, "unsupported_reason", lambda: None)
  monkeypatch.setattr(huge_pages, "private_mappings", lambda: [(10 * page, 14 * page)])
  calls = []
  refusals = {11 * page: 2, 12 * page: 9}  # region -> times the kernel refuses it

  def fake(start, end):
    assert end - start == page
    calls.append(start)
    if refusals.get(start, 0) > 0:
      refusals[start] -= 1
      return 11  # EAGAIN
    return 0

  monkeypatch.setattr(huge_pages, "_madvise_collapse", fake)
  ranges = [(10 * page + 100, page), (11 * page + 200, 2 * page), (13 * page + 300, 2 * page)]
  covered = huge_pages.collapse(ranges, attempts=3, retry_delay_s=0)
  # Regions 10 and 11 collapse (11 at its third attempt), 12 is refused three times, 13 collapses; 14 and 15 lie
  # past the mapping, so the kernel is not asked. Region 11 (shared by the first two ranges) is asked once.
  assert calls == [10 * page, 11 * page, 11 * page, 11 * page, 12 * page, 12 * page, 12 * page, 13 * page]
  assert covered == page + (page - 200 + 200) + (page - 300)
