"""RMSNorm (plain and zero-centred) and the Gated DeltaNet gated norm against float64 NumPy."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxtext.layers.normalizations import RMSNorm, gated_rms_norm, rms_norm

BF16 = ml_dtypes.bfloat16


def _ref(x, w, eps, zero_centered):
  x = x.astype(np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y * ((1.0 + w) if zero_centered else w)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_float32_matches_float64_reference(zero_centered):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 24)).astype(np.float32) * 3
  w = rng.normal(size=(24,)).astype(np.float32)
  out = rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, zero_centered=zero_centered)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), _ref(x, w.astype(np.float64), 1e-6, zero_centered), atol=2e-6)


def test_rms_norm_eps_is_inside_the_rsqrt():
  x = np.full((1, 4), 1e-3, np.float32)
  out = rms_norm(jnp.asarray(x), jnp.ones(4), eps=1e-2, zero_centered=False)
  np.testing.assert_allclose(np.asarray(out), 1e-3 / np.sqrt(1e-6 + 1e-2), rtol=1e-6)


def test_rms_norm_bfloat16_rounding_order_of_both_conventions():
  """Plain: cast the normalised value to bf16, then multiply by w in bf16. Zero-centred: multiply in fp32, cast."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(64, 32)).astype(BF16)
  w = (rng.normal(size=(32,)) * 2).astype(BF16)
  x32 = x.astype(np.float32)
  normed = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(1e-6))
  plain_ref = (normed.astype(BF16).astype(np.float32) * w.astype(np.float32)).astype(BF16)
  zc_ref = (normed * (np.float32(1) + w.astype(np.float32))).astype(BF16)
  plain = rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, zero_centered=False)
  zc = rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, zero_centered=True)
  assert plain.dtype == jnp.bfloat16 and zc.dtype == jnp.bfloat16
  # Allow one bf16 ulp for fp32 rsqrt/mean differences; most entries must match exactly.
  for got, want in ((plain, plain_ref), (zc, zc_ref)):
    got32, want32 = np.asarray(got).astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(got32, want32, rtol=2**-7, atol=0)
    assert np.mean(got32 == want32) > 0.98


def test_gated_rms_norm_matches_reference():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(2, 7, 4, 24)).astype(np.float32)
  z = rng.normal(size=(2, 7, 4, 24)).astype(np.float32)
  w = rng.normal(size=(24,)).astype(np.float32)
  out = gated_rms_norm(jnp.asarray(x), jnp.asarray(z), jnp.asarray(w), eps=1e-6)
  z64 = z.astype(np.float64)
  ref = _ref(x, w.astype(np.float64), 1e-6, False) * z64 / (1 + np.exp(-z64))
  np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6)


@pytest.mark.parametrize("zero_centered,init", [(False, 1.0), (True, 0.0)])
def test_rms_norm_module_init_and_call(zero_centered, init):
  norm = RMSNorm(8, eps=1e-5, zero_centered=zero_centered, weight_dtype=jnp.bfloat16)
  assert norm.scale[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(norm.scale[...], np.float32), np.full(8, init, np.float32))
  x = np.arange(16, dtype=np.float32).reshape(2, 8)
  np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), _ref(x, np.ones(8) * init, 1e-5, zero_centered), atol=3e-6)


def test_rms_norm_module_rejects_empty_feature_axis():
  with pytest.raises(ValueError, match="RMSNorm num_features must be positive, got 0"):
    RMSNorm(0, eps=1e-6, zero_centered=False)
