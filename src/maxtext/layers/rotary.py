"""Rotary position embedding: half-split (`rotate_half`) layout, full or partial rotary dim, scaling variants.

YaRN (gpt-oss) blends interpolated and extrapolated frequencies over a ramp of dims and multiplies cos and sin by
an attention factor, so q . k is scaled by its square.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """Static description of one layer's rotary embedding.

  Attributes:
    rotary_dim: number of leading head dims that rotate (even); the rest pass through.
    theta: base timescale.
    rope_type: "default" | "linear" (positions divided by `scaling_factor`) | "llama3" (Llama 3.1 band scaling) |
      "yarn" (YaRN ramp between interpolated and extrapolated frequencies).
    scaling_factor: factor of linear / llama3 / yarn scaling.
    low_freq_factor: llama3 low-frequency factor.
    high_freq_factor: llama3 high-frequency factor.
    original_max_position_embeddings: llama3 / yarn original context length.
    beta_fast: yarn rotation count that bounds the extrapolated (high-frequency) dims.
    beta_slow: yarn rotation count that bounds the interpolated (low-frequency) dims.
    truncate: yarn rounds the ramp bounds to whole dims (floor / ceil).
    attention_factor: yarn multiplier of cos and sin; 0 derives it as `0.1 ln(factor) + 1` (1 when factor <= 1).
  """

  rotary_dim: int
  theta: float
  rope_type: str = "default"
  scaling_factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 0.0

  def __post_init__(self) -> None:
    if self.rotary_dim <= 0 or self.rotary_dim % 2:
      raise ValueError(f"RopeSpec.rotary_dim must be a positive even number, got {self.rotary_dim}")
    if self.theta <= 0:
      raise ValueError(f"RopeSpec.theta must be positive, got {self.theta}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"RopeSpec.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
    if self.rope_type != "default" and self.scaling_factor <= 0:
      raise ValueError(f"RopeSpec.scaling_factor must be positive for {self.rope_type}, got {self.scaling_factor}")
    if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          "llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
          f"{self.high_freq_factor} <= {self.low_freq_factor}"
      )
    if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
      raise ValueError(f"yarn rope scaling needs beta_fast > beta_slow > 0, got {self.beta_fast} and {self.beta_slow}")
    if self.attention_factor < 0:
      raise ValueError(f"RopeSpec.attention_factor must be >= 0 (0 = derived), got {self.attention_factor}")

  def attention_scaling(self) -> float:
    """The multiplier of cos and sin: yarn's attention factor, 1 for the other types."""
    if self.rope_type != "yarn":
      return 1.0
    if self.attention_factor > 0:
      return float(self.attention_factor)
    return 1.0 if self.scaling_factor <= 1 else 0.1 * math.log(self.scaling_factor) + 1.0

  def inv_freq(self) -> np.ndarray:
    """Inverse frequencies `[rotary_dim // 2]` (float32, computed like transformers)."""
    exponents = np.arange(0, self.rotary_dim, 2, dtype=np.float32) / np.float32(self.rotary_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(self.theta), exponents)).astype(np.float32)
    if self.rope_type == "linear":
      return (inv_freq / np.float32(self.scaling_factor)).astype(np.float32)
    if self.rope_type == "llama3":
      return _llama3_scale(inv_freq, self)
    if self.rope_type == "yarn":
      return _yarn_scale(inv_freq, self)
    return inv_freq


def _yarn_correction_dim(rotations: float, spec: RopeSpec) -> float:
  """The (fractional) dim whose wavelength makes `rotations` turns over the original context."""
  dim, length = spec.rotary_dim, spec.original_max_position_embeddings
  return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))


def _yarn_scale(inv_freq: np.ndarray, spec: RopeSpec) -> np.ndarray:
  """YaRN: dims below the `beta_fast` bound keep their frequency, dims above `beta_slow` are divided by the factor,
  a linear ramp in between (float32, as transformers computes it)."""
  low, high = _yarn_correction_dim(spec.beta_fast, spec), _yarn_correction_dim(spec.beta_slow, spec)
  if spec.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, spec.rotary_dim - 1)
  if low == high:
    high += 0.001  # a one-dim ramp would divide by zero
  ramp = np.clip((np.arange(spec.rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
  keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolate (keep), 0: interpolate (divide)
  exponents = np.arange(0, spec.rotary_dim, 2, dtype=np.float32) / np.float32(spec.rotary_dim)
  pos_freqs = np.power(np.float32(spec.theta), exponents).astype(np.float32)
  interpolated = (np.float32(1.0) / (np.float32(spec.scaling_factor) * pos_freqs)).astype(np.float32)
  return (interpolated * (np.float32(1.0) - keep) + inv_freq * keep).astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, spec: RopeSpec) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths divided by the factor, short kept, a smooth blend in between."""
  factor = np.float32(spec.scaling_factor)
  old_len = np.float32(spec.original_max_position_embeddings)
  low_wavelen = old_len / np.float32(spec.low_freq_factor)
  high_wavelen = old_len / np.float32(spec.high_freq_factor)
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - np.float32(spec.low_freq_factor)) / np.float32(
      spec.high_freq_factor - spec.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotate_half(x: jax.Array) -> jax.Array:
  """`[x1, x2] -> [-x2, x1]` over the last axis (pairs (i, i + d/2))."""
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, spec: RopeSpec) -> jax.Array:
  """Rotates the first `spec.rotary_dim` dims of every head.

  Angles are formed in float32; cos/sin (times yarn's attention factor) are cast to the dtype of `x` (as
  transformers does).

  Args:
    x: `[..., T, H, Dh]` queries or keys.
    positions: `[..., T]` integer positions (leading axes broadcast with those of `x`).
    spec: rotary spec with `rotary_dim <= Dh`.

  Returns:
    `[..., T, H, Dh]` in the dtype of `x`.
  """
  rd = spec.rotary_dim
  if rd > x.shape[-1]:
    raise ValueError(f"rotary_dim {rd} exceeds head dim {x.shape[-1]}")
  inv_freq = jnp.asarray(spec.inv_freq())
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, rd/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, rd]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  scaling = spec.attention_scaling()
  if scaling != 1.0:
    cos, sin = cos * scaling, sin * scaling
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  x_rot = x[..., :rd]
  rotated = x_rot * cos + rotate_half(x_rot) * sin
  if rd == x.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x[..., rd:]], axis=-1)
