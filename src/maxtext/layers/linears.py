"""Dense projections with multi-axis inputs and outputs (kernels stored [in..., out...], or in a layout of the kernel
backend's own: `DenseGeneral.relayout`), made by the kernel backend (`KernelBackend.project`)."""

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.kernels.backend import KernelBackend, default_backend
from maxtext.layers.initializers import constant, draw_key, fan_in_uniform


def _as_shape(features: int | Sequence[int], name: str) -> tuple[int, ...]:
  """Normalises a feature size or tuple of sizes to a tuple of positive ints."""
  shape = (features,) if isinstance(features, (int, np.integer)) else tuple(features)
  if not shape or any(not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
    raise ValueError(f"{name} must be a positive int or a non-empty tuple of positive ints, got {features!r}")
  return tuple(int(s) for s in shape)


def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    *,
    num_in_axes: int,
    dtype: jnp.dtype,
    backend: KernelBackend | None = None,
) -> jax.Array:
  """Contracts the trailing `num_in_axes` axes of `x` with the leading axes of `kernel`, on `backend`.

  Args:
    x: input `[..., *in_shape]`.
    kernel: `[*in_shape, *out_shape]`.
    bias: `[*out_shape]` or None.
    num_in_axes: number of contracted axes.
    dtype: compute dtype; `x`, `kernel` and `bias` are cast to it.
    backend: the kernel backend making the product (default: the reference backend, XLA's dot).

  Returns:
    `[..., *out_shape]` in `dtype`.
  """
  backend = default_backend() if backend is None else backend
  out_shape = tuple(kernel.shape[num_in_axes:])
  return backend.project(
      x, [kernel], [bias], num_in_axes=num_in_axes, out_shapes=[out_shape], layouts=[None], dtype=dtype
  )[0]


class DenseGeneral(nnx.Module):
  """Linear map from `in_features` (one or more trailing axes) to `out_features` (one or more axes).

  Parameters: `kernel [*in, *out]` (or, after `relayout`, in a backend's own layout, named by `layout`) and, with
  `use_bias`, `bias [*out]`.
  """

  def __init__(
      self,
      in_features: int | Sequence[int],
      out_features: int | Sequence[int],
      *,
      use_bias: bool = False,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.in_shape = _as_shape(in_features, "in_features")
    self.out_shape = _as_shape(out_features, "out_features")
    self.dtype = jnp.dtype(dtype)
    fan_in = math.prod(self.in_shape)
    self.kernel = nnx.Param(fan_in_uniform(draw_key(rngs), self.in_shape + self.out_shape, weight_dtype, fan_in))
    self.bias = nnx.Param(constant(rngs, self.out_shape, weight_dtype, 0.0)) if use_bias else None
    self.layout: str | None = None  # the backend layout `kernel` is in (`relayout`); None: [*in, *out]

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, backend: KernelBackend | None = None
  ) -> jax.Array:
    """Applies the projection on `backend` (default: the reference backend): `[..., *in] -> [..., *out]`."""
    return project(x, (self,), backend)[0]

  def relayout(self, layout: str, convert: Callable[[Any, jnp.dtype], Any]) -> int:
    """Stores `kernel` as `convert(kernel as its [K, N] matrix, compute dtype)` returns, tagged `layout`, in place;
    a backend's `prepare_params` calls it, and its `project` reads the layout. Works on an abstract model
    (`jax.ShapeDtypeStruct` parameters) too.

    Args:
      layout: the layout's name (the backend's).
      convert: makes the stored kernel from the `[K, N]` matrix (a NumPy view of a loaded kernel, or a
        `jax.ShapeDtypeStruct`), or returns None when the layout does not serve this kernel.

    Returns:
      The bytes of `kernel` now in `layout` (0 when `convert` declined).

    Raises:
      ValueError: the kernel is already in another layout.
    """
    if self.layout is not None and self.layout != layout:
      raise ValueError(
          f"DenseGeneral: the kernel is in the {self.layout!r} layout already, cannot relay it as {layout!r}"
      )
    if self.layout is None:
      kernel = self.kernel.get_value()
      size_in, size_out = math.prod(self.in_shape), math.prod(self.out_shape)
      if isinstance(kernel, jax.ShapeDtypeStruct):
        flat = jax.ShapeDtypeStruct((size_in, size_out), kernel.dtype)
      else:
        # A loaded kernel is reshaped by NumPy (a view; `convert` copies it once): an eager XLA reshape compiles a
        # program per shape, a few tenths of a second of a hybrid model's load.
        flat = np.asarray(kernel).reshape(size_in, size_out)
      stored = convert(flat, self.dtype)
      if stored is None:
        return 0
      self.kernel.set_value(stored)
      self.layout = layout
    kernel = self.kernel.get_value()
    return math.prod(kernel.shape) * jnp.dtype(kernel.dtype).itemsize

  def restore_layout(self, convert: Callable[[Any], Any]) -> None:
    """Stores `kernel` as `[*in, *out]` again (`relayout`'s inverse), in place: `convert` makes the `[K, N]` matrix
    of the stored kernel. A kernel in no backend layout is left as it is."""
    if self.layout is None:
      return
    self.kernel.set_value(jnp.asarray(convert(self.kernel.get_value())).reshape(self.in_shape + self.out_shape))
    self.layout = None


def _check_input(x: jax.Array, in_shape: tuple[int, ...]) -> None:
  if x.shape[x.ndim - len(in_shape) :] != in_shape:
    raise ValueError(f"DenseGeneral expects trailing input axes {in_shape}, got input shape {x.shape}")


def project(x: jax.Array, layers: Sequence[DenseGeneral], backend: KernelBackend | None = None) -> tuple[jax.Array, ...]:
  """`layer(x)` for each of `layers`, on `backend` (default: the reference backend): the projections a block takes
  from one input (queries, keys and values; gate and up).

  Layers that share their input axes and compute dtype go to the backend's `project` together (a backend may make
  them in one call, with results equal bit for bit to the layers called one by one); other layers one by one.

  Raises:
    ValueError: `layers` is empty, or `x`'s trailing axes are not a layer's input axes.
  """
  if not layers:
    raise ValueError("project takes one or more layers, got none")
  first = layers[0]
  if any(l.in_shape != first.in_shape or l.dtype != first.dtype for l in layers):
    return tuple(layer(x, backend) for layer in layers)
  _check_input(x, first.in_shape)
  backend = default_backend() if backend is None else backend
  return backend.project(
      x,
      [l.kernel[...] for l in layers],
      [None if l.bias is None else l.bias[...] for l in layers],
      num_in_axes=len(first.in_shape),
      out_shapes=[l.out_shape for l in layers],
      layouts=[l.layout for l in layers],
      dtype=first.dtype,
  )
