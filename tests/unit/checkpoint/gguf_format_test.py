"""The GGUF container reader against the `gguf` library: files written by `gguf.GGUFWriter`, metadata of every value
type compared with `gguf.GGUFReader`'s, tensors with `gguf.quants.dequantize` (K-quants, which `gguf` cannot quantize,
from random valid blocks; Q8_K, which it cannot dequantize, against ggml's definition), and hand-made broken
headers."""

import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import gguf_blocks
from maxtext.checkpoint import gguf_format

gguf = pytest.importorskip("gguf")

K_QUANTS = gguf_blocks.K_QUANTS[:-1]  # the gguf library dequantizes these (not Q8_K) but cannot quantize them
# Types `gguf.quants.quantize` writes (K-quants are random valid blocks; the gguf library has no Q8_K at all).
QUANTIZABLE = tuple(t for t in gguf_format.DEQUANTIZED_TYPES if not t.endswith("_K"))


def _write(path, fields=(), tensors=(), alignment=None):
  writer = gguf.GGUFWriter(str(path), "llama")
  if alignment is not None:
    writer.add_uint32("general.alignment", alignment)
  for key, value, kind in fields:
    writer.add_key_value(key, value, kind)
  for name, array, raw_dtype in tensors:
    writer.add_tensor(name, array, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def _fields():
  vt = gguf.GGUFValueType
  return [
      ("u8", 200, vt.UINT8),
      ("i8", -5, vt.INT8),
      ("u16", 60000, vt.UINT16),
      ("i16", -30000, vt.INT16),
      ("u32", 4_000_000_000, vt.UINT32),
      ("i32", -2_000_000_000, vt.INT32),
      ("f32", 0.1, vt.FLOAT32),
      ("u64", 2**63 + 5, vt.UINT64),
      ("i64", -(2**62), vt.INT64),
      ("f64", 1e-300, vt.FLOAT64),
      ("yes", True, vt.BOOL),
      ("no", False, vt.BOOL),
      ("text", "héllo wörld", vt.STRING),
      ("empty", "", vt.STRING),
      ("ints", [3, -1, 7], vt.ARRAY),
      ("floats", [0.5, -2.25], vt.ARRAY),
      ("words", ["a", "Ġb", "", "<|im_end|>"], vt.ARRAY),
      ("flags", [True, False, True], vt.ARRAY),
  ]


def test_metadata_of_every_value_type_reads_as_gguf_reads_it(tmp_path):
  path = _write(tmp_path / "m.gguf", _fields())
  container = gguf_format.GGUFContainer(path)
  reference = gguf.GGUFReader(str(path))
  stored = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}  # the reader's header values
  assert set(container.fields) == set(stored)
  for key, field in stored.items():
    assert container.fields[key] == field.contents(), key
  assert container.fields["u64"] == 2**63 + 5 and container.fields["text"] == "héllo wörld"
  assert container.fields["flags"] == [True, False, True] and container.fields["f32"] == np.float32(0.1)


@pytest.mark.parametrize("alignment", [None, 64])
@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_tensors_dequantize_as_gguf_dequantizes_them(tmp_path, type_name, alignment):
  qtype = gguf.GGMLQuantizationType[type_name]
  rng = np.random.default_rng(3)
  x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 4  # [a, b, c]: gguf lists the dims as (64, 5, 3)
  odd = rng.standard_normal((7,)).astype(np.float32)  # a tensor that leaves the next one unaligned
  if type_name == "F32":
    data, raw = x, None
  elif type_name == "F16":
    data, raw = x.astype(np.float16), None
  else:
    data, raw = gguf.quants.quantize(x, qtype), qtype
  path = _write(tmp_path / "t.gguf", tensors=[("odd", odd, None), ("t", data, raw)], alignment=alignment)
  container = gguf_format.GGUFContainer(path)
  infos = {t.name: t for t in container.tensors}
  assert infos["t"].shape == (3, 5, 64) and infos["t"].type_name == type_name
  reference = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
  expected = gguf.quants.dequantize(np.asarray(reference["t"].data), qtype)
  got = container.dequantize(infos["t"])
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, np.asarray(expected, np.float32).reshape(3, 5, 64))
  np.testing.assert_array_equal(container.dequantize(infos["odd"]), odd)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "F16", "F32"])
def test_a_bfloat16_read_rounds_float32_and_never_holds_the_tensor_in_float32(tmp_path, monkeypatch, type_name):
  """Read in bfloat16 a chunk at a time: bit for bit the float32 read cast to bfloat16; the read's peak memory stays
  below the result plus a few chunks, under the 1 MiB a float32 copy of the tensor would take."""
  qtype = gguf.GGMLQuantizationType[type_name]
  x = np.random.default_rng(5).standard_normal((256, 1024)).astype(np.float32)
  data = x if type_name == "F32" else x.astype(np.float16) if type_name == "F16" else gguf.quants.quantize(x, qtype)
  path = _write(tmp_path / "t.gguf", tensors=[("t", data, None if type_name in ("F32", "F16") else qtype)])
  container = gguf_format.GGUFContainer(path)
  (info,) = container.tensors
  want = container.dequantize(info).astype(ml_dtypes.bfloat16)
  monkeypatch.setattr(gguf_format, "CHUNK_VALUES", 4096)
  tracemalloc.start()
  try:
    got = container.dequantize(info, ml_dtypes.bfloat16)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert got.dtype == ml_dtypes.bfloat16 and got.shape == (256, 1024)
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
  assert peak < got.nbytes + 16 * 4096 * 4 < x.nbytes


@pytest.mark.parametrize("alignment", [None, 64])
@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quant_tensors_dequantize_bit_for_bit_as_gguf_dequantizes_them(tmp_path, type_name, alignment):
  qtype = gguf.GGMLQuantizationType[type_name]
  rng = np.random.default_rng(7)
  data = gguf_blocks.random_k_blocks(type_name, (3, 2, 512), rng)
  odd = rng.standard_normal((7,)).astype(np.float32)
  path = _write(tmp_path / "k.gguf", tensors=[("odd", odd, None), ("t", data, qtype)], alignment=alignment)
  container = gguf_format.GGUFContainer(path)
  info = {t.name: t for t in container.tensors}["t"]
  assert info.shape == (3, 2, 512) and info.type_name == type_name
  assert container.nbytes(info) == data.nbytes
  got = container.dequantize(info)
  expected = gguf.quants.dequantize(data, qtype)
  assert got.dtype == np.float32 and expected.shape == got.shape
  assert np.array_equal(got, expected.astype(np.float32))


def test_q8_k_is_d_times_q(tmp_path):
  """Q8_K (d float32, 256 int8, 16 int16 sums): ggml's dequantize_row_q8_K is `d * q`; the gguf library has none."""
  data = gguf_blocks.random_k_blocks("Q8_K", (4, 512), np.random.default_rng(8))
  path = _write(tmp_path / "k.gguf", tensors=[("t", data, gguf.GGMLQuantizationType.Q8_K)])
  container = gguf_format.GGUFContainer(path)
  (info,) = container.tensors
  blocks = data.reshape(-1, 292)
  expected = blocks[:, :4].copy().view(np.float32) * blocks[:, 4:260].view(np.int8).astype(np.float32)
  assert np.array_equal(container.dequantize(info), expected.reshape(4, 512))


@pytest.mark.parametrize("chunk_values", [256, 512, 700])
@pytest.mark.parametrize("type_name", [*K_QUANTS, "Q4_0"])
def test_a_chunk_boundary_inside_a_tensor_is_seamless(tmp_path, monkeypatch, type_name, chunk_values):
  """Chunks of 1, 2 or 2 super-blocks over a tensor of 5, the last one short (700 is no multiple of a block; Q4_0:
  8, 16 or 21 blocks of 32 over 40)."""
  qtype = gguf.GGMLQuantizationType[type_name]
  rng = np.random.default_rng(9)
  if type_name in K_QUANTS:
    data = gguf_blocks.random_k_blocks(type_name, (5, 256), rng)
  else:
    data = gguf.quants.quantize(rng.standard_normal((5, 256)).astype(np.float32), qtype)
  path = _write(tmp_path / "k.gguf", tensors=[("t", data, qtype)])
  container = gguf_format.GGUFContainer(path)
  (info,) = container.tensors
  monkeypatch.setattr(gguf_format, "CHUNK_VALUES", chunk_values)
  assert np.array_equal(container.dequantize(info), gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_a_k_quant_bfloat16_read_rounds_float32_and_never_holds_the_tensor_in_float32(tmp_path, monkeypatch, type_name):
  qtype = gguf.GGMLQuantizationType[type_name]
  data = gguf_blocks.random_k_blocks(type_name, (256, 1024), np.random.default_rng(10))
  path = _write(tmp_path / "k.gguf", tensors=[("t", data, qtype)])
  container = gguf_format.GGUFContainer(path)
  (info,) = container.tensors
  want = gguf.quants.dequantize(data, qtype).astype(np.float32).astype(ml_dtypes.bfloat16)
  monkeypatch.setattr(gguf_format, "CHUNK_VALUES", 4096)
  tracemalloc.start()
  try:
    got = container.dequantize(info, ml_dtypes.bfloat16)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert got.dtype == ml_dtypes.bfloat16 and got.shape == (256, 1024)
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
  assert peak < got.nbytes + 16 * 4096 * 4 < 256 * 1024 * 4


def _header(version=3, tensors=0, fields=0, body=b""):
  return b"GGUF" + struct.pack("<IQQ", version, tensors, fields) + body


def _key(name: str) -> bytes:
  return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    "data, match",
    [
        (b"GGUF", "4 bytes is shorter than a GGUF header"),
        (b"GGML" + bytes(20), r"starts with b'GGML', not the GGUF magic"),
        (_header(version=1), r"GGUF version 1 is not supported \(supported: \(2, 3\)\)"),
        (_header(fields=1, body=_key("k") + struct.pack("<I", 13)), "metadata value type 13 at byte 33"),
        (_header(fields=1, body=_key("k") + struct.pack("<IQ", 8, 99) + b"abc"), "string of 99 bytes"),
        (_header(fields=2, body=_key("k") + struct.pack("<IB", 0, 1)), "ends early or is corrupt at byte"),
        (
            _header(fields=1, body=_key("general.alignment") + struct.pack("<II", 4, 12)),
            "general.alignment must be a positive multiple of 8, got 12",
        ),
    ],
)
def test_broken_headers_are_named(tmp_path, data, match):
  path = tmp_path / "bad.gguf"
  path.write_bytes(data)
  with pytest.raises(gguf_format.GGUFFormatError, match=match):
    gguf_format.GGUFContainer(path)


def test_a_tensor_past_the_end_is_found_by_check_extent(tmp_path):
  path = _write(tmp_path / "t.gguf", tensors=[("t", np.ones((4, 32), np.float32), None)])
  path.write_bytes(path.read_bytes()[:-8])
  container = gguf_format.GGUFContainer(path)
  with pytest.raises(gguf_format.GGUFFormatError, match="tensor 't' ends at byte .*, past the end of the file"):
    container.check_extent(container.tensors[0])
  assert container.nbytes(container.tensors[0]) == 4 * 32 * 4
