"""DenseGeneral: multi-axis kernels [in..., out...], bias, dtypes, validation, a backend's layout (column panels)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.kernels.backend import default_backend
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import PANELS, CpuBackend, to_panels
from maxtext.layers.linears import DenseGeneral, dense_general, project

needs_kernel = pytest.mark.skipif(cpu_gemm.unsupported_reason() is not None, reason="the kernel needs AVX2 and FMA")


def _use_panels(layer):
  return layer.relayout(PANELS, to_panels) > 0


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


def _float64(layer, x):
  """The layer's map in float64 NumPy from its kernel before it goes into panels (`kernel` [*in, *out])."""
  kernel, bias = np.asarray(layer.kernel[...], np.float64), np.asarray(layer.bias[...], np.float64)
  flat = x.reshape(x.shape[0], -1).astype(np.float64) @ kernel.reshape(int(np.prod(layer.in_shape)), -1)
  return flat.reshape((x.shape[0],) + layer.out_shape) + bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 70])
def test_panels_keep_the_layer_s_map_on_the_kernel_and_off_it(rows, monkeypatch):
  """One row, 2-8 rows (the lanes), more (a prefill, six at a time), and XLA's dot where the kernel does not serve;
  the reference backend refuses the layout."""
  layer = DenseGeneral((2, 24), (4, 16), use_bias=True, rngs=nnx.Rngs(rows))
  layer.bias[...] = jnp.asarray(np.random.default_rng(rows).standard_normal((4, 16)), jnp.float32)
  x = np.random.default_rng(rows + 1).standard_normal((rows, 2, 24)).astype(np.float32)
  want = _float64(layer, x)
  assert _use_panels(layer) and layer.layout == PANELS and layer.kernel[...].shape == (2, 48, 32)
  on_kernel = layer(jnp.asarray(x), CpuBackend())
  monkeypatch.setattr(cpu_gemm, "applies", lambda *_: False)
  monkeypatch.setattr(cpu_gemm, "applies_panels", lambda *_: False)
  off_kernel = layer(jnp.asarray(x), CpuBackend())
  for got in (on_kernel, off_kernel):
    assert got.shape == (rows, 4, 16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want).max())))
  assert _use_panels(layer)  # already in panels: unchanged
  assert layer.kernel[...].shape == (2, 48, 32)
  with pytest.raises(ValueError, match=r"kernel_backend=reference: kernels\[0\] is in the 'panels' layout"):
    layer(jnp.asarray(x), default_backend())
  with pytest.raises(ValueError, match=r"in the 'panels' layout already, cannot relay it as 'other'"):
    layer.relayout("other", lambda flat, dtype: flat)


@pytest.mark.parametrize(
    "in_f, out_f, dtype",
    [(16, 48, jnp.float32), (16, 2 * cpu_gemm.MAX_PANEL_COLUMNS, jnp.float32), (16, 64, jnp.bfloat16)],
)
def test_panels_leave_kernels_the_kernel_does_not_read_as_they_are(in_f, out_f, dtype):
  """N not a multiple of 32, wider than MAX_PANEL_COLUMNS, or not float32: left as they are."""
  layer = DenseGeneral(in_f, out_f, dtype=dtype, weight_dtype=dtype, rngs=nnx.Rngs(0))
  before = np.asarray(layer.kernel[...])
  assert not _use_panels(layer) and layer.layout is None
  np.testing.assert_array_equal(np.asarray(layer.kernel[...]), before)


@needs_kernel
def test_prepare_params_counts_the_bytes_and_works_on_shapes():
  class Block(nnx.Module):
    """A projection of 64 outputs (into panels) and a router of 7 (not a multiple of 32)."""

    def __init__(self, rngs):
      self.q = DenseGeneral(32, (2, 32), rngs=rngs)
      self.router = DenseGeneral(32, 7, rngs=rngs)

  block = Block(nnx.Rngs(0))
  backend = CpuBackend()
  assert backend.prepare_params(block) == 32 * 64 * 4 and block.q.layout == PANELS and block.router.layout is None
  abstract = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
  assert backend.prepare_params(abstract) == 32 * 64 * 4
  assert default_backend().prepare_params(abstract) == 0
  assert abstract.q.kernel.get_value() == jax.ShapeDtypeStruct((2, 32, 32), jnp.float32)


def test_panels_of_loaded_weights_compile_no_program(caplog):
  """A loaded multi-axis kernel goes into panels by NumPy: no XLA program per shape (a load's time), same values."""
  layer = DenseGeneral((2, 16), (3, 32), rngs=nnx.Rngs(0))
  before = np.asarray(layer.kernel[...]).reshape(32, 96)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    assert _use_panels(layer)
  assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
  np.testing.assert_array_equal(np.asarray(cpu_gemm.from_panels(layer.kernel[...])), before)


@pytest.mark.skipif(cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA")
def test_project_takes_panels_past_eight_rows_and_row_major_kernels_to_xla():
  """At 12 rows only the layers in panels share the kernel's call; each output equals the layer alone."""
  rngs = nnx.Rngs(0)
  layers = [DenseGeneral(32, 64, rngs=rngs), DenseGeneral(32, 40, rngs=rngs), DenseGeneral(32, (2, 16), rngs=rngs)]
  _use_panels(layers[0])
  _use_panels(layers[2])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((12, 32)), jnp.float32)
  backend = CpuBackend()
  jaxpr = str(jax.make_jaxpr(lambda x: project(x, layers, backend))(x))
  together = project(x, layers, backend)
  one_by_one = [layer(x, backend) for layer in layers]
  assert jaxpr.count("ffi_call") == 1 and jaxpr.count("dot_general") == 1
  for got, want in zip(together, one_by_one):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
