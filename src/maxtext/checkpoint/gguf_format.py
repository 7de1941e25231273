"""The GGUF container read directly: header, metadata, tensor index, and the block types this package dequantizes.

A GGUF file (version 2 or 3, little-endian) is:
  magic `GGUF`, version u32, tensor count u64, metadata count u64;
  metadata: key (string), value type u32, value (an array is its element type u32, count u64, then the elements);
  tensor index: name (string), n_dims u32, dims u64 each (innermost first), ggml type u32, offset u64;
  the data section, at the next multiple of `general.alignment` (32 by default) after the index; each tensor's
  offset is relative to it.
A string is its byte length u64 then UTF-8 bytes. The file is memory-mapped: opening reads the header and the
index only, and a tensor's bytes are read when it is dequantized. The vocabulary of a tokenizer is a metadata array
of tens of thousands of strings, so strings are cut straight out of the mapping without per-item objects beyond
the decoded `str`.

Dequantization (`dequantize`) follows ggml's block formats: a block of 32 weights holds a float16 scale `d` (and,
for the `_1` types, a float16 minimum `m`), 4-, 5- or 8-bit integers `q`, and the weight is `d * q` (`_0` types,
`q` centred: 4-bit `q - 8`, 5-bit `q - 16`) or `d * q + m` (`_1` types). The nibbles of byte `j` of a 4-bit block
are weights `j` (low) and `j + 16` (high); a 5-bit block adds bit `j` of a u32 as the fifth bit of weight `j`.

The K-quants pack 256 weights in a super-block of 16 (Q2_K, Q3_K, Q6_K) or 8 (Q4_K, Q5_K) sub-blocks, each with its
own integer scale (and for Q2_K, Q4_K, Q5_K an integer minimum) multiplied by the float16 super-block scale `d`
(minimum `dmin`): weight = `(d * scale) * q` or `(d * scale) * q - dmin * min`, in float32, rounded after each
operation as the `gguf` library rounds. Small fields are packed several to a byte: in a run of `r` bytes (32; 64
for Q6_K's low nibbles) byte `j` holds field `k` of weight `r k + j`, from bit `k * width` up. Q2_K: 2-bit `q`, the
sub-block's scale and minimum the low and high nibble of a byte. Q3_K: 2-bit `q` plus a high bit that, when clear,
subtracts 4; sixteen 6-bit scales (minus 32) packed in 12 bytes. Q4_K / Q5_K: 4-bit `q` (Q5_K plus a fifth bit);
eight 6-bit scales and minimums in 12 bytes. Q6_K: 4 low bits and 2 high bits, minus 32; int8 scales. Q8_K: a
float32 `d`, int8 `q`, and per-16 sums the weights do not need.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any, Callable

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml's tensor type ids and names (the names the gguf library and llama.cpp print).
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
_HALF = "<f2"
# Block record of every type `dequantize` reads: numpy structured dtype, weights per block.
_BLOCKS: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 1),
    "F16": (np.dtype(_HALF), 1),
    "BF16": (np.dtype("<u2"), 1),
    "Q8_0": (np.dtype([("d", _HALF), ("q", "i1", 32)]), 32),
    "Q4_0": (np.dtype([("d", _HALF), ("q", "u1", 16)]), 32),
    "Q4_1": (np.dtype([("d", _HALF), ("m", _HALF), ("q", "u1", 16)]), 32),
    "Q5_0": (np.dtype([("d", _HALF), ("h", "<u4"), ("q", "u1", 16)]), 32),
    "Q5_1": (np.dtype([("d", _HALF), ("m", _HALF), ("h", "<u4"), ("q", "u1", 16)]), 32),
    "Q2_K": (np.dtype([("scales", "u1", 16), ("q", "u1", 64), ("d", _HALF), ("dmin", _HALF)]), 256),
    "Q3_K": (np.dtype([("hmask", "u1", 32), ("q", "u1", 64), ("scales", "u1", 12), ("d", _HALF)]), 256),
    "Q4_K": (np.dtype([("d", _HALF), ("dmin", _HALF), ("scales", "u1", 12), ("q", "u1", 128)]), 256),
    "Q5_K": (np.dtype([("d", _HALF), ("dmin", _HALF), ("scales", "u1", 12), ("qh", "u1", 32), ("q", "u1", 128)]), 256),
    "Q6_K": (np.dtype([("q", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", _HALF)]), 256),
    "Q8_K": (np.dtype([("d", "<f4"), ("q", "i1", 256), ("bsums", "<i2", 16)]), 256),
}
DEQUANTIZED_TYPES: tuple[str, ...] = tuple(_BLOCKS)
CHUNK_VALUES = 1 << 20  # weights a read dequantizes at a time (4 MiB of float32, whatever the tensor's size)
# Metadata value types: id -> numpy dtype of a scalar (8 string, 9 array, 7 bool are read apart).
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("u1"), 1: np.dtype("i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
    5: np.dtype("<i4"), 6: np.dtype("<f4"), 10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}  # fmt: skip
_BOOL, _STRING, _ARRAY = 7, 8, 9


class GGUFFormatError(ValueError):
  """The bytes are not a GGUF file this reader understands (bad magic, version, value type, or truncated)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One entry of the tensor index: `shape` is row-major (the file's dims reversed), `type_name` ggml's name."""

  name: str
  shape: tuple[int, ...]
  type_name: str
  type_id: int
  offset: int  # from the start of the file


class GGUFContainer:
  """A memory-mapped GGUF file: `fields` (metadata key -> value), `tensors` (the index, in file order).

  Values are Python objects: str, int, float, bool, or a list of them for an array.

  Args:
    path: the file.

  Raises:
    OSError: the file cannot be opened or mapped.
    GGUFFormatError: not a GGUF file (names what was found and at which byte), or a tensor reaching past the end.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    with open(self.path, "rb") as f:
      self.size = os.fstat(f.fileno()).st_size
      if self.size < 24:
        raise GGUFFormatError(f"{self.size} bytes is shorter than a GGUF header (24 bytes)")
      self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    self._pos = 0
    try:
      self._read_header()
    except GGUFFormatError:
      raise
    except (struct.error, IndexError, ValueError) as e:  # a read past the end; ValueError: numpy's, bad UTF-8
      raise GGUFFormatError(f"the header ends early or is corrupt at byte {self._pos}: {e}") from None

  def _read_header(self) -> None:
    magic = self._map[:4]
    if magic != MAGIC:
      raise GGUFFormatError(f"the file starts with {magic!r}, not the GGUF magic {MAGIC!r}")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", self._map, 4)
    if version not in VERSIONS:
      raise GGUFFormatError(f"GGUF version {version} is not supported (supported: {VERSIONS})")
    self._pos = 24
    self.fields: dict[str, Any] = {}
    for _ in range(num_fields):
      key = self._string()
      self.fields[key] = self._value(self._u32())
    alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
      raise GGUFFormatError(f"general.alignment must be a positive multiple of 8, got {alignment!r}")
    index = []
    for _ in range(num_tensors):
      name = self._string()
      (n_dims,) = struct.unpack_from("<I", self._map, self._pos)
      dims = struct.unpack_from(f"<{n_dims}QIQ", self._map, self._pos + 4)
      self._pos += 4 + 8 * n_dims + 12
      index.append((name, tuple(reversed(dims[:n_dims])), dims[n_dims], dims[n_dims + 1]))
    data_start = -(-self._pos // alignment) * alignment
    self.tensors = [
        TensorInfo(name, shape, GGML_TYPES.get(type_id, ""), type_id, data_start + offset)
        for name, shape, type_id, offset in index
    ]

  def _u32(self) -> int:
    (value,) = struct.unpack_from("<I", self._map, self._pos)
    self._pos += 4
    return value

  def _string(self) -> str:
    (n,) = struct.unpack_from("<Q", self._map, self._pos)
    start = self._pos + 8
    if start + n > self.size:
      raise IndexError(f"a string of {n} bytes reaches past the end")
    self._pos = start + n
    return self._map[start : self._pos].decode("utf-8")

  def _strings(self, count: int) -> list[str]:
    """`count` strings from the current position: a vocabulary is tens of thousands, so this loop stays lean."""
    data, pos, size, unpack = self._map, self._pos, self.size, struct.Struct("<Q").unpack_from
    values = []
    append = values.append
    for _ in range(count):
      (n,) = unpack(data, pos)
      pos += 8 + n
      if pos > size:
        raise IndexError(f"a string of {n} bytes reaches past the end")
      append(data[pos - n : pos].decode("utf-8"))
    self._pos = pos
    return values

  def _value(self, kind: int) -> Any:
    if kind == _STRING:
      return self._string()
    if kind == _BOOL:
      self._pos += 1
      return self._map[self._pos - 1] != 0
    if kind in _SCALARS:
      dtype = _SCALARS[kind]
      (value,) = np.frombuffer(self._map, dtype, 1, self._pos).tolist()
      self._pos += dtype.itemsize
      return value
    if kind == _ARRAY:
      item_kind = self._u32()
      (count,) = struct.unpack_from("<Q", self._map, self._pos)
      self._pos += 8
      if item_kind in _SCALARS:
        dtype = _SCALARS[item_kind]
        values = np.frombuffer(self._map, dtype, count, self._pos).tolist()
        self._pos += dtype.itemsize * count
        return values
      if item_kind == _BOOL:
        values = [b != 0 for b in self._map[self._pos : self._pos + count]]
        self._pos += count
        return values
      if item_kind == _STRING:
        return self._strings(count)
      return [self._value(item_kind) for _ in range(count)]
    raise GGUFFormatError(f"metadata value type {kind} at byte {self._pos - 4} is not a GGUF value type")

  def nbytes(self, tensor: TensorInfo) -> int:
    """The bytes of `tensor`'s data (its type must be one `dequantize` reads)."""
    block, per_block = _BLOCKS[tensor.type_name]
    return int(np.prod(tensor.shape, dtype=np.int64)) // per_block * block.itemsize

  def check_extent(self, tensor: TensorInfo) -> None:
    """Raises GGUFFormatError when `tensor`'s data does not fit in the file."""
    end = tensor.offset + self.nbytes(tensor)
    if end > self.size:
      raise GGUFFormatError(f"tensor {tensor.name!r} ends at byte {end}, past the end of the file")

  def dequantize(self, tensor: TensorInfo, dtype: Any = np.float32) -> np.ndarray:
    """`tensor` in `dtype` (float32, or a narrower float such as bfloat16) in its row-major shape (a new array; the
    mapping is only read). The blocks are dequantized `CHUNK_VALUES` weights at a time into float32, each chunk cast
    into the result (to nearest, ties to even): a tensor read in bfloat16 is never held whole in float32."""
    block, per_block = _BLOCKS[tensor.type_name]
    count = int(np.prod(tensor.shape, dtype=np.int64))
    raw = np.frombuffer(self._map, block, count // per_block, tensor.offset)
    out = np.empty(count, dtype)
    step = max(1, CHUNK_VALUES // per_block)  # blocks per chunk
    for first in range(0, raw.shape[0], step):
      chunk = raw[first : first + step]
      out[first * per_block : (first + chunk.shape[0]) * per_block] = dequantize(chunk, tensor.type_name)
    return out.reshape(tensor.shape)


def dequantize(blocks: np.ndarray, type_name: str) -> np.ndarray:
  """Float32 weights of `blocks` (a 1-D array of `type_name`'s block records), flattened."""
  if type_name == "F32":
    return blocks.astype(np.float32)
  if type_name == "F16":
    return blocks.astype(np.float32)
  if type_name == "BF16":
    return (blocks.astype(np.uint32) << 16).view(np.float32)
  if type_name in _K_QUANTS:
    return _K_QUANTS[type_name](blocks).reshape(-1)
  d = blocks["d"].astype(np.float32)[:, None]  # [nb, 1]
  out = np.empty((blocks.shape[0], 32), np.float32)  # [nb, 32]
  if type_name == "Q8_0":
    np.multiply(d, blocks["q"], out=out)
    return out.reshape(-1)
  packed = blocks["q"]  # [nb, 16]: byte j holds weights j (low nibble) and j + 16 (high nibble)
  q = np.empty((blocks.shape[0], 32), np.uint8)
  np.bitwise_and(packed, 0x0F, out=q[:, :16])
  np.right_shift(packed, 4, out=q[:, 16:])
  if type_name in ("Q5_0", "Q5_1"):
    bits = (blocks["h"][:, None] >> np.arange(32, dtype=np.uint32)) & 1  # [nb, 32]: the fifth bit of weight j
    q |= (bits << 4).astype(np.uint8)
  if type_name in ("Q4_1", "Q5_1"):
    np.multiply(d, q, out=out)
    out += blocks["m"].astype(np.float32)[:, None]
    return out.reshape(-1)
  centre = 8 if type_name == "Q4_0" else 16
  np.multiply(d, q.view(np.int8) - np.int8(centre), out=out)
  return out.reshape(-1)


def _unpack(packed: np.ndarray, run: int, width: int) -> np.ndarray:
  """The `width`-bit fields of `packed` ([nb, n] uint8, runs of `run` bytes) in weight order: [nb, n * 8 // width].

  Byte `j` of a run holds, from bit `k * width` up, weight `run * k + j` of the weights that run packs."""
  nb = packed.shape[0]
  shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]  # [8 / width, 1]
  fields = packed.reshape(nb, -1, 1, run) >> shifts  # [nb, runs, 8 / width, run]
  fields &= np.uint8((1 << width) - 1)
  return fields.reshape(nb, -1)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K's eight 6-bit scales and minimums from 12 bytes [nb, 12]: bytes 0-3 hold scales 0-3 in their low
  6 bits, bytes 4-7 minimums 0-3; bytes 8-11 the low 4 bits of scale (low nibble) and minimum (high nibble) 4-7, whose
  top 2 bits are the top bits of bytes 0-3 (scales) and 4-7 (minimums). Returns float32 [nb, 8, 1] each."""
  low, mins, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
  sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1)
  mn = np.concatenate([mins & 0x3F, (high >> 4) | ((mins >> 2) & 0x30)], axis=1)
  return sc.astype(np.float32)[:, :, None], mn.astype(np.float32)[:, :, None]


def _q2_k(blocks: np.ndarray) -> np.ndarray:  # [nb] -> [nb, 16, 16]
  nb = blocks.shape[0]
  d, dmin = blocks["d"].astype(np.float32)[:, None], blocks["dmin"].astype(np.float32)[:, None]  # [nb, 1]
  scales = blocks["scales"]  # [nb, 16]: scale in the low nibble, minimum in the high one
  dl = (d * (scales & 0x0F).astype(np.float32))[:, :, None]  # [nb, 16, 1]
  ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
  q = _unpack(blocks["q"], 32, 2).reshape(nb, 16, 16)
  out = dl * q
  out -= ml
  return out


def _q3_k(blocks: np.ndarray) -> np.ndarray:  # [nb] -> [nb, 16, 16]
  nb = blocks.shape[0]
  packed = blocks["scales"]  # [nb, 12]: low 4 bits of scales 0-15 as nibbles of bytes 0-7, top 2 bits in 8-11
  low = _unpack(packed[:, :8], 8, 4)  # [nb, 16]
  high = _unpack(packed[:, 8:], 4, 2)  # [nb, 16]
  scales = (low | (high << 4)).view(np.int8) - np.int8(32)
  dl = (blocks["d"].astype(np.float32)[:, None] * scales.astype(np.float32))[:, :, None]  # [nb, 16, 1]
  q = _unpack(blocks["q"], 32, 2).view(np.int8)  # [nb, 256]
  q -= (_unpack(blocks["hmask"], 32, 1) ^ np.uint8(1)).view(np.int8) << 2  # a clear high bit subtracts 4
  return dl * q.reshape(nb, 16, 16)


def _q4_k(blocks: np.ndarray) -> np.ndarray:  # [nb] -> [nb, 8, 32]; Q4_K and Q5_K
  nb = blocks.shape[0]
  sc, mn = _scale_min_k4(blocks["scales"])
  dl = blocks["d"].astype(np.float32)[:, None, None] * sc  # [nb, 8, 1]
  ml = blocks["dmin"].astype(np.float32)[:, None, None] * mn
  q = _unpack(blocks["q"], 32, 4)
  if "qh" in blocks.dtype.names:  # Q5_K
    q |= _unpack(blocks["qh"], 32, 1) << 4
  out = dl * q.reshape(nb, 8, 32)
  out -= ml
  return out


def _q6_k(blocks: np.ndarray) -> np.ndarray:  # [nb] -> [nb, 16, 16]
  nb = blocks.shape[0]
  q = _unpack(blocks["q"], 64, 4)  # [nb, 256]: two halves of 128 weights, each 64 bytes of low nibbles
  q |= _unpack(blocks["qh"], 32, 2) << 4
  q = q.view(np.int8) - np.int8(32)
  dl = (blocks["d"].astype(np.float32)[:, None] * blocks["scales"].astype(np.float32))[:, :, None]  # [nb, 16, 1]
  return dl * q.reshape(nb, 16, 16)


def _q8_k(blocks: np.ndarray) -> np.ndarray:  # [nb] -> [nb, 256]
  return blocks["d"][:, None] * blocks["q"].astype(np.float32)


# K-quant type -> float32 weights of its blocks (the 256 of each block, in order, in the trailing axes).
_K_QUANTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q4_k,
    "Q6_K": _q6_k,
    "Q8_K": _q8_k,
}
