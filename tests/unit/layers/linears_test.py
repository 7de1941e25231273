"""DenseGeneral: multi-axis kernels [in..., out...], bias, dtypes, validation."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.layers.linears import DenseGeneral, dense_general


@pytest.mark.parametrize("in_f,out_f", [(6, 5), (6, (2, 3)), ((2, 3), 4)])
def test_dense_general_matches_numpy(in_f, out_f):
  layer = DenseGeneral(in_f, out_f, use_bias=True, rngs=nnx.Rngs(0))
  in_shape = (in_f,) if isinstance(in_f, int) else in_f
  out_shape = (out_f,) if isinstance(out_f, int) else out_f
  assert layer.kernel[...].shape == in_shape + out_shape and layer.bias[...].shape == out_shape
  layer.bias[...] = jnp.arange(np.prod(out_shape), dtype=jnp.float32).reshape(out_shape)
  x = np.random.default_rng(0).normal(size=(3, 4) + in_shape).astype(np.float32)
  kernel = np.asarray(layer.kernel[...], np.float64).reshape(np.prod(in_shape), -1)
  ref = x.reshape(3, 4, -1).astype(np.float64) @ kernel
  ref = ref.reshape((3, 4) + out_shape) + np.asarray(layer.bias[...])
  np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), ref, atol=1e-5)


def test_dense_general_dtypes_and_no_bias():
  layer = DenseGeneral(4, 3, dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  assert layer.bias is None and layer.kernel[...].dtype == jnp.bfloat16
  assert layer(jnp.ones((2, 4))).dtype == jnp.bfloat16
  out = dense_general(jnp.ones((2, 4)), jnp.ones((4, 3)), None, num_in_axes=1, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.full((2, 3), 4.0))


def test_init_is_seeded_and_fan_in_scaled():
  a = DenseGeneral(256, 128, rngs=nnx.Rngs(3)).kernel[...]
  b = DenseGeneral(256, 128, rngs=nnx.Rngs(3)).kernel[...]
  c = DenseGeneral(256, 128, rngs=nnx.Rngs(4)).kernel[...]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(a), np.asarray(c))
  assert float(jnp.std(a)) == pytest.approx(256**-0.5, rel=0.02)


def test_dense_general_rejects_wrong_input_shape():
  layer = DenseGeneral((2, 3), 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"expects trailing input axes \(2, 3\), got input shape \(5, 6\)"):
    layer(jnp.ones((5, 6)))


@pytest.mark.parametrize("bad", [0, (), (2, -1), (2.0,)])
def test_dense_general_rejects_bad_features(bad):
  with pytest.raises(ValueError, match="in_features must be a positive int or a non-empty tuple"):
    DenseGeneral(bad, 4, rngs=nnx.Rngs(0))
