"""Hash-based initialiser: determinism, moments, independence of keys, works under eval_shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.layers.initializers import ShapeOnlyRngs, computed, constant, draw_key, fan_in_uniform, uniform


def test_uniform_is_deterministic_per_key_and_has_requested_moments():
  key = jax.random.key(0)
  a = np.asarray(uniform(key, (300, 200), jnp.float32, std=0.5, mean=2.0))
  b = np.asarray(uniform(key, (300, 200), jnp.float32, std=0.5, mean=2.0))
  np.testing.assert_array_equal(a, b)
  assert a.mean() == pytest.approx(2.0, abs=5e-3)
  assert a.std() == pytest.approx(0.5, rel=5e-3)
  half_width = 0.5 * np.sqrt(3.0)
  assert a.min() >= 2.0 - half_width and a.max() <= 2.0 + half_width


def test_different_keys_give_uncorrelated_values():
  a = np.asarray(uniform(jax.random.key(1), (10000,), jnp.float32, std=1.0))
  b = np.asarray(uniform(jax.random.key(2), (10000,), jnp.float32, std=1.0))
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
  assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.05  # neighbouring counters are uncorrelated too


def test_fan_in_uniform_scale_and_dtype():
  x = fan_in_uniform(jax.random.key(5), (64, 400), jnp.bfloat16, fan_in=64)
  assert x.dtype == jnp.bfloat16 and x.shape == (64, 400)
  assert float(jnp.std(x.astype(jnp.float32))) == pytest.approx(1 / 8, rel=0.03)


def test_abstract_evaluation_allocates_nothing():
  out = jax.eval_shape(lambda: fan_in_uniform(jax.random.key(0), (2**20, 2**11), jnp.bfloat16, 4))
  assert out.shape == (2**20, 2**11) and out.dtype == jnp.bfloat16


def test_rejects_parameters_beyond_the_counter_range():
  with pytest.raises(ValueError, match=r"cannot initialise a parameter of 4294967296 elements \(limit 2\*\*32\)"):
    jax.eval_shape(lambda: uniform(jax.random.key(0), (2**16, 2**16), jnp.float32, 1.0))


def test_shape_only_rngs_draw_no_key_and_give_only_shapes():
  assert draw_key(ShapeOnlyRngs()) is None
  x = fan_in_uniform(draw_key(ShapeOnlyRngs()), (3, 5), jnp.bfloat16, fan_in=3)
  assert x == jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)
  assert constant(ShapeOnlyRngs(), (4,), jnp.float32, 1.0) == jax.ShapeDtypeStruct((4,), jnp.float32)
  never_called = lambda: pytest.fail("a shape-only build must not compute a value")  # pylint: disable=unnecessary-lambda-assignment
  assert computed(ShapeOnlyRngs(), (2, 3), jnp.bfloat16, never_called) == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
  with pytest.raises(ValueError, match="limit 2\\*\\*32"):
    uniform(None, (2**16, 2**16), jnp.float32, std=1.0)


def test_constant_and_computed_values_with_real_rngs():
  for rngs in (nnx.Rngs(0), None):
    np.testing.assert_array_equal(np.asarray(constant(rngs, (3,), jnp.bfloat16, 1.0), np.float32), np.ones(3))
  value = computed(nnx.Rngs(0), (3,), jnp.float32, lambda: jnp.arange(3, dtype=jnp.float32))
  np.testing.assert_array_equal(np.asarray(value), [0.0, 1.0, 2.0])
  with pytest.raises(ValueError, match=r"an initializer made \(2,\) float32, its parameter is \(3,\) float32"):
    computed(nnx.Rngs(0), (3,), jnp.float32, lambda: jnp.zeros(2, jnp.float32))
