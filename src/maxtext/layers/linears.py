"""Dense projections with multi-axis inputs and outputs (kernels stored [in..., out...], or in column panels for the
CPU kernel: `use_panels`)."""

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.kernels import cpu_gemm
from maxtext.layers.initializers import draw_key, fan_in_uniform


def _as_shape(features: int | Sequence[int], name: str) -> tuple[int, ...]:
  """Normalises a feature size or tuple of sizes to a tuple of positive ints."""
  shape = (features,) if isinstance(features, (int, np.integer)) else tuple(features)
  if not shape or any(not isinstance(s, (int, np.integer)) or s <= 0 for s in shape):
    raise ValueError(f"{name} must be a positive int or a non-empty tuple of positive ints, got {features!r}")
  return tuple(int(s) for s in shape)


def dense_general(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *, num_in_axes: int, dtype: jnp.dtype
) -> jax.Array:
  """Contracts the trailing `num_in_axes` axes of `x` with the leading axes of `kernel`.

  Args:
    x: input `[..., *in_shape]`.
    kernel: `[*in_shape, *out_shape]`.
    bias: `[*out_shape]` or None.
    num_in_axes: number of contracted axes.
    dtype: compute dtype; `x`, `kernel` and `bias` are cast to it.

  Returns:
    `[..., *out_shape]` in `dtype`.
  """
  return dense_generals(x, (kernel,), (bias,), num_in_axes=num_in_axes, dtype=dtype)[0]


def dense_generals(
    x: jax.Array,
    kernels: Sequence[jax.Array],
    biases: Sequence[jax.Array | None],
    *,
    num_in_axes: int,
    dtype: jnp.dtype,
) -> tuple[jax.Array, ...]:
  """`dense_general` of one `x` with each kernel and its bias (same arguments, one result per kernel).

  Where the small-batch kernel serves the product (`cpu_gemm.applies`), several kernels run in one call
  (`cpu_gemm.matmuls`, bit for bit the results of one call each); otherwise each is its own XLA dot.
  """
  out_shapes = [tuple(kernel.shape[num_in_axes:]) for kernel in kernels]
  return _products(x, kernels, [False] * len(kernels), out_shapes, biases, num_in_axes=num_in_axes, dtype=dtype)


def _products(
    x: jax.Array,
    kernels: Sequence[jax.Array],
    panels: Sequence[bool],
    out_shapes: Sequence[tuple[int, ...]],
    biases: Sequence[jax.Array | None],
    *,
    num_in_axes: int,
    dtype: jnp.dtype,
) -> tuple[jax.Array, ...]:
  """`dense_generals` where kernel i is `[*in, *out_shapes[i]]`, or in column panels `[N / PANEL, K, PANEL]` when
  `panels[i]` (K, N the sizes of the in and out axes; `DenseGeneral.use_panels`).

  The small-batch kernel takes every kernel at 1 to 8 rows, and kernels in panels at any number of rows, in one call;
  the others are XLA dots (outside the kernel's reach, a kernel in panels is copied out of them for its dot).
  """
  x = x.astype(dtype)
  kernels = [kernel.astype(dtype) for kernel in kernels]
  batch_shape, in_shape = x.shape[: x.ndim - num_in_axes], x.shape[x.ndim - num_in_axes :]
  rows, size_in = math.prod(batch_shape), math.prod(in_shape)
  dtypes = (x.dtype, *(kernel.dtype for kernel in kernels))
  small, any_rows = cpu_gemm.applies(rows, *dtypes), cpu_gemm.applies_panels(rows, *dtypes)
  on_kernel = [i for i, in_panels in enumerate(panels) if small or (in_panels and any_rows)]
  ys: list[jax.Array | None] = [None] * len(kernels)
  if on_kernel:
    flat_x = x.reshape(rows, size_in)
    flat_kernels = [kernels[i] if panels[i] else kernels[i].reshape(size_in, math.prod(out_shapes[i])) for i in on_kernel]
    flats = (cpu_gemm.matmul(flat_x, flat_kernels[0]),) if len(on_kernel) == 1 else cpu_gemm.matmuls(flat_x, flat_kernels)
    for i, flat in zip(on_kernel, flats):
      ys[i] = flat.reshape(batch_shape + out_shapes[i])
  contract = ((tuple(range(x.ndim - num_in_axes, x.ndim)), tuple(range(num_in_axes))), ((), ()))
  for i, kernel in enumerate(kernels):
    if ys[i] is None:
      kernel = cpu_gemm.from_panels(kernel).reshape(in_shape + out_shapes[i]) if panels[i] else kernel
      ys[i] = jax.lax.dot_general(x, kernel, contract)
  return tuple(y if bias is None else y + bias.astype(dtype) for y, bias in zip(ys, biases))


class DenseGeneral(nnx.Module):
  """Linear map from `in_features` (one or more trailing axes) to `out_features` (one or more axes).

  Parameters: `kernel [*in, *out]` (or, after `use_panels`, `[N / PANEL, K, PANEL]`) and, with `use_bias`,
  `bias [*out]`.
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
    self.bias = nnx.Param(jnp.zeros(self.out_shape, weight_dtype)) if use_bias else None
    self.panels = False  # whether `kernel` is in column panels (`use_panels`)

  def __call__(self, x: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """Applies the projection: `[..., *in] -> [..., *out]`."""
    _check_input(x, self.in_shape)
    bias = None if self.bias is None else self.bias[...]
    return _products(
        x, [self.kernel[...]], [self.panels], [self.out_shape], [bias], num_in_axes=len(self.in_shape), dtype=self.dtype
    )[0]

  def use_panels(self) -> bool:
    """Stores `kernel` in column panels `[N / PANEL, K, PANEL]` (`cpu_gemm.to_panels` of the `[K, N]` matrix it
    flattens to), which the CPU kernel reads faster in a decode step; the layer computes the same function.

    Only a float32 kernel and compute dtype (panels serve only the float32 kernel) with N a multiple of
    `cpu_gemm.PANEL`, at most `cpu_gemm.MAX_PANEL_COLUMNS`, changes; works on an abstract model
    (`jax.ShapeDtypeStruct` parameters) too.

    Returns:
      Whether `kernel` is in panels now.
    """
    if self.panels:
      return True
    kernel = self.kernel.get_value()
    size_in, size_out = math.prod(self.in_shape), math.prod(self.out_shape)
    fits = size_out % cpu_gemm.PANEL == 0 and size_out <= cpu_gemm.MAX_PANEL_COLUMNS
    if not fits or kernel.dtype != jnp.float32 or self.dtype != jnp.float32:
      return False
    if isinstance(kernel, jax.ShapeDtypeStruct):
      flat = jax.ShapeDtypeStruct((size_in, size_out), kernel.dtype)
    else:
      # A loaded kernel is reshaped by NumPy (a view; `to_panels` copies it once): an eager XLA reshape compiles a
      # program per shape, a few tenths of a second of a hybrid model's load.
      flat = np.asarray(kernel).reshape(size_in, size_out)
    self.kernel.set_value(cpu_gemm.to_panels(flat))
    self.panels = True
    return True


def use_panels(module: nnx.Module) -> int:
  """`DenseGeneral.use_panels` on every dense layer inside `module`, in place; returns the bytes now in panels."""
  total = 0
  for _, layer in nnx.iter_modules(module):
    if isinstance(layer, DenseGeneral) and layer.use_panels():
      kernel = layer.kernel.get_value()
      total += math.prod(kernel.shape) * jnp.dtype(kernel.dtype).itemsize
  return total


def _check_input(x: jax.Array, in_shape: tuple[int, ...]) -> None:
  if x.shape[x.ndim - len(in_shape) :] != in_shape:
    raise ValueError(f"DenseGeneral expects trailing input axes {in_shape}, got input shape {x.shape}")


def project(x: jax.Array, layers: Sequence[DenseGeneral]) -> tuple[jax.Array, ...]:
  """`layer(x)` for each of `layers`: the projections a block takes from one input (queries, keys and values; gate
  and up).

  Layers that share their input axes and compute dtype go through `dense_generals` together: one kernel call where
  the small-batch kernel serves the step, with results equal bit for bit to the layers called one by one; other
  layers are called one by one.

  Raises:
    ValueError: `layers` is empty, or `x`'s trailing axes are not a layer's input axes.
  """
  if not layers:
    raise ValueError("project takes one or more layers, got none")
  first = layers[0]
  if any(l.in_shape != first.in_shape or l.dtype != first.dtype for l in layers):
    return tuple(layer(x) for layer in layers)
  _check_input(x, first.in_shape)
  return _products(
      x,
      [l.kernel[...] for l in layers],
      [l.panels for l in layers],
      [l.out_shape for l in layers],
      [None if l.bias is None else l.bias[...] for l in layers],
      num_in_axes=len(first.in_shape),
      dtype=first.dtype,
  )
