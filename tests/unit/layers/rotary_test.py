"""RoPE: half-split layout, partial rotary dim, llama3 / linear / yarn scaling, per-layer theta."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from support import reference
from maxtext.layers.rotary import RopeSpec, apply_rope, rotate_half


def _ref_inv_freq(rd, theta, rope_type="default", factor=1.0, low=1.0, high=4.0, orig=8192):
  freqs = [theta ** (-(2 * i) / rd) for i in range(rd // 2)]
  if rope_type == "linear":
    return np.array([f / factor for f in freqs])
  if rope_type == "llama3":
    out = []
    for f in freqs:
      wavelen = 2 * math.pi / f
      if wavelen < orig / high:
        out.append(f)
      elif wavelen > orig / low:
        out.append(f / factor)
      else:
        s = (orig / wavelen - low) / (high - low)
        out.append((1 - s) * f / factor + s * f)
    return np.array(out)
  return np.array(freqs)


def _ref_rope(x, positions, freqs):
  """x [T, H, Dh] float64; pairs (i, i + rd/2) of the first rd = 2*len(freqs) dims rotate by position * freq."""
  out = x.astype(np.float64).copy()
  half = len(freqs)
  for t, p in enumerate(positions):
    ang = p * freqs
    a, b = x[t, :, :half].astype(np.float64), x[t, :, half : 2 * half].astype(np.float64)
    out[t, :, :half] = a * np.cos(ang) - b * np.sin(ang)
    out[t, :, half : 2 * half] = b * np.cos(ang) + a * np.sin(ang)
  return out


@pytest.mark.parametrize(
    "spec_kwargs,ref_args",
    [
        ({"rotary_dim": 32, "theta": 10000.0}, (32, 10000.0)),
        ({"rotary_dim": 8, "theta": 1e7}, (8, 1e7)),
        ({"rotary_dim": 16, "theta": 1e6, "rope_type": "linear", "scaling_factor": 8.0}, (16, 1e6, "linear", 8.0)),
        (
            {
                "rotary_dim": 128,
                "theta": 500000.0,
                "rope_type": "llama3",
                "scaling_factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            (128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
        ),
    ],
)
def test_inv_freq_matches_reference(spec_kwargs, ref_args):
  got = RopeSpec(**spec_kwargs).inv_freq()
  assert got.dtype == np.float32 and got.shape == (spec_kwargs["rotary_dim"] // 2,)
  np.testing.assert_allclose(got, _ref_inv_freq(*ref_args), rtol=2e-6)


def test_llama3_scaling_covers_all_three_bands():
  spec = RopeSpec(16, 500000.0, "llama3", 8.0, 1.0, 4.0, 64)
  base = RopeSpec(16, 500000.0).inv_freq()
  ratio = spec.inv_freq() / base
  assert ratio[0] == pytest.approx(1.0)  # short wavelength kept
  assert ratio[-1] == pytest.approx(1 / 8)  # long wavelength divided by the factor
  assert np.any((ratio > 1 / 8 + 1e-3) & (ratio < 1 - 1e-3))  # blended band
  np.testing.assert_allclose(spec.inv_freq(), _ref_inv_freq(16, 500000.0, "llama3", 8.0, 1.0, 4.0, 64), rtol=2e-6)


@pytest.mark.parametrize("rotary_dim,theta", [(32, 10000.0), (8, 10000.0), (32, 1e6)])
def test_apply_rope_full_and_partial_matches_reference(rotary_dim, theta):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 11, 3, 32)).astype(np.float32)
  pos = np.stack([np.arange(11), np.arange(5, 16)]).astype(np.int32)
  spec = RopeSpec(rotary_dim, theta)
  out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), spec))
  freqs = _ref_inv_freq(rotary_dim, theta)
  for b in range(2):
    np.testing.assert_allclose(out[b], _ref_rope(x[b], pos[b], freqs), atol=2e-5)
  np.testing.assert_array_equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.slow
def test_two_thetas_give_different_rotations():
  x = jnp.ones((1, 6, 1, 16))
  pos = jnp.arange(6)[None]
  local = apply_rope(x, pos, RopeSpec(16, 10000.0))
  glob = apply_rope(x, pos, RopeSpec(16, 1e6))
  assert float(jnp.abs(local - glob).max()) > 1e-2
  np.testing.assert_array_equal(np.asarray(local[:, 0]), np.asarray(x[:, 0]))  # position 0 is the identity


@pytest.mark.slow
def test_apply_rope_bfloat16_keeps_dtype():
  x = jnp.ones((4, 2, 8), jnp.bfloat16)
  out = apply_rope(x, jnp.arange(4), RopeSpec(8, 10000.0))
  assert out.dtype == jnp.bfloat16
  ref = _ref_rope(np.ones((4, 2, 8)), np.arange(4), _ref_inv_freq(8, 10000.0))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)


def test_rotate_half():
  np.testing.assert_array_equal(np.asarray(rotate_half(jnp.array([1.0, 2.0, 3.0, 4.0]))), [-3.0, -4.0, 1.0, 2.0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rotary_dim": 7, "theta": 1.0}, "rotary_dim must be a positive even number, got 7"),
        ({"rotary_dim": 0, "theta": 1.0}, "rotary_dim must be a positive even number, got 0"),
        ({"rotary_dim": 8, "theta": 0.0}, "theta must be positive, got 0.0"),
        ({"rotary_dim": 8, "theta": 1.0, "rope_type": "dynamic"}, "rope_type must be one of .*got 'dynamic'"),
        (
            {"rotary_dim": 8, "theta": 1.0, "rope_type": "yarn", "beta_fast": 1.0, "beta_slow": 1.0},
            "yarn rope scaling needs beta_fast > beta_slow > 0, got 1.0 and 1.0",
        ),
        ({"rotary_dim": 8, "theta": 1.0, "attention_factor": -1.0}, "attention_factor must be >= 0"),
        ({"rotary_dim": 8, "theta": 1.0, "rope_type": "linear", "scaling_factor": 0.0}, "scaling_factor must be pos"),
        (
            {"rotary_dim": 8, "theta": 1.0, "rope_type": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 4.0},
            "high_freq_factor > low_freq_factor",
        ),
    ],
)
def test_rope_spec_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RopeSpec(**kwargs)


def test_apply_rope_rejects_rotary_dim_above_head_dim():
  with pytest.raises(ValueError, match="rotary_dim 16 exceeds head dim 8"):
    apply_rope(jnp.ones((2, 1, 8)), jnp.arange(2), RopeSpec(16, 10000.0))


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_blends_kept_and_scaled_frequencies_and_scales_cos_sin(truncate):
  spec = RopeSpec(
      rotary_dim=32, theta=150000.0, rope_type="yarn", scaling_factor=8.0, original_max_position_embeddings=32,
      truncate=truncate,
  )  # fmt: skip
  base = reference.inv_freq(32, 150000.0)
  ref = reference.inv_freq(32, 150000.0, "yarn", 8.0, original_max=32, truncate=truncate)
  np.testing.assert_allclose(spec.inv_freq(), ref, rtol=2e-6)
  # The three bands: the fastest frequency kept, the slowest divided by the factor, some strictly in between.
  assert ref[0] == base[0] and math.isclose(ref[-1], base[-1] / 8.0)
  assert np.any((ref < base) & (ref > base / 8.0))
  mscale = 0.1 * math.log(8.0) + 1.0
  assert math.isclose(spec.attention_scaling(), mscale)
  assert math.isclose(RopeSpec(rotary_dim=8, theta=1e4, rope_type="yarn", attention_factor=1.5).attention_scaling(), 1.5)
  x = np.random.default_rng(0).normal(size=(5, 2, 32)).astype(np.float32)
  positions = np.array([0, 3, 17, 40, 100])
  got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), spec))
  np.testing.assert_allclose(got, mscale * _ref_rope(x, positions, ref), atol=2e-5)
