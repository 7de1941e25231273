"""Rotary position embedding: half-split (`rotate_half`) layout, full or partial rotary dim, scaling variants."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """Static description of one layer's rotary embedding.

  Attributes:
    rotary_dim: number of leading head dims that rotate (even); the rest pass through.
    theta: base timescale.
    rope_type: "default" | "linear" (positions divided by `scaling_factor`) | "llama3" (Llama 3.1 band scaling).
    scaling_factor: factor of linear / llama3 scaling.
    low_freq_factor: llama3 low-frequency factor.
    high_freq_factor: llama3 high-frequency factor.
    original_max_position_embeddings: llama3 original context length.
  """

  rotary_dim: int
  theta: float
  rope_type: str = "default"
  scaling_factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

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

  def inv_freq(self) -> np.ndarray:
    """Inverse frequencies `[rotary_dim // 2]` (float32, computed like transformers)."""
    exponents = np.arange(0, self.rotary_dim, 2, dtype=np.float32) / np.float32(self.rotary_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(self.theta), exponents)).astype(np.float32)
    if self.rope_type == "linear":
      return (inv_freq / np.float32(self.scaling_factor)).astype(np.float32)
    if self.rope_type == "llama3":
      return _llama3_scale(inv_freq, self)
    return inv_freq


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

  Angles are formed in float32; cos/sin are cast to the dtype of `x` (as transformers does).

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
  cos = jnp.cos(angles).astype(x.dtype)
  sin = jnp.sin(angles).astype(x.dtype)
  x_rot = x[..., :rd]
  rotated = x_rot * cos + rotate_half(x_rot) * sin
  if rd == x.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x[..., rd:]], axis=-1)
