"""Random valid blocks of the GGUF K-quants, which the `gguf` library dequantizes but cannot quantize.

`random_k_blocks(type_name, shape, rng)` is the bytes of a `type_name` tensor of row-major `shape` in ggml's layout
([..., blocks per row * block bytes], uint8): random integers everywhere (every bit pattern is a valid integer
field) and finite float scales from subnormal to large, of either sign, at the block's float offsets.
"""

import numpy as np

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")
# (bytes per block of 256 weights, byte offsets of its float16 scales d / dmin; Q8_K: of its float32 d)
_LAYOUT = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
    "Q8_K": (292, (0,)),
}


def random_k_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  """The bytes of a `type_name` tensor of `shape` (its last axis a multiple of 256): see the module docstring."""
  block_bytes, offsets = _LAYOUT[type_name]
  n_blocks = int(np.prod(shape)) // 256
  blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
  scale_dtype = np.dtype(np.float32 if type_name == "Q8_K" else np.float16)
  for at in offsets:
    scales = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 3, n_blocks)).astype(scale_dtype)
    blocks[:, at : at + scale_dtype.itemsize] = scales.view(np.uint8).reshape(n_blocks, -1)
  return blocks.reshape(*shape[:-1], shape[-1] // 256 * block_bytes)
