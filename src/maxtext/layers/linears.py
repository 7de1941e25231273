"""Dense projections with multi-axis inputs and outputs (kernels stored [in..., out...])."""

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
  x = x.astype(dtype)
  kernel = kernel.astype(dtype)
  batch_shape, in_shape = x.shape[: x.ndim - num_in_axes], x.shape[x.ndim - num_in_axes :]
  rows, size_in = math.prod(batch_shape), math.prod(in_shape)
  if cpu_gemm.applies(rows, x.dtype, kernel.dtype):
    out_shape = kernel.shape[num_in_axes:]
    flat = cpu_gemm.matmul(x.reshape(rows, size_in), kernel.reshape(size_in, math.prod(out_shape)))
    y = flat.reshape(batch_shape + out_shape)
  else:
    contract_x = tuple(range(x.ndim - num_in_axes, x.ndim))
    contract_k = tuple(range(num_in_axes))
    y = jax.lax.dot_general(x, kernel, ((contract_x, contract_k), ((), ())))
  if bias is not None:
    y = y + bias.astype(dtype)
  return y


class DenseGeneral(nnx.Module):
  """Linear map from `in_features` (one or more trailing axes) to `out_features` (one or more axes).

  Parameters: `kernel [*in, *out]` and, with `use_bias`, `bias [*out]`.
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

  def __call__(self, x: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """Applies the projection: `[..., *in] -> [..., *out]`."""
    _check_input(x, self.in_shape)
    bias = None if self.bias is None else self.bias[...]
    return dense_general(x, self.kernel[...], bias, num_in_axes=len(self.in_shape), dtype=self.dtype)


def _check_input(x: jax.Array, in_shape: tuple[int, ...]) -> None:
  if x.shape[x.ndim - len(in_shape) :] != in_shape:
    raise ValueError(f"DenseGeneral expects trailing input axes {in_shape}, got input shape {x.shape}")


def project(x: jax.Array, layers: Sequence[DenseGeneral]) -> tuple[jax.Array, ...]:
  """`layer(x)` for each of `layers`: the projections a block takes from one input (queries, keys and values; gate
  and up).

  Where the small-batch kernel serves the step (`cpu_gemm.applies`) and the layers share their input axes and
  compute dtype, all of them run in one kernel call (`cpu_gemm.matmuls`), with results equal bit for bit to the
  layers called one by one; otherwise the layers are called one by one.

  Raises:
    ValueError: `layers` is empty, or `x`'s trailing axes are not a layer's input axes.
  """
  if not layers:
    raise ValueError("project takes one or more layers, got none")
  first = layers[0]
  if len(layers) == 1 or any(l.in_shape != first.in_shape or l.dtype != first.dtype for l in layers):
    return tuple(layer(x) for layer in layers)
  _check_input(x, first.in_shape)
  num_in_axes, dtype = len(first.in_shape), first.dtype
  batch_shape = x.shape[: x.ndim - num_in_axes]
  rows, size_in = math.prod(batch_shape), math.prod(first.in_shape)
  if not cpu_gemm.applies(rows, dtype):
    return tuple(layer(x) for layer in layers)
  kernels = [l.kernel[...].astype(dtype).reshape(size_in, math.prod(l.out_shape)) for l in layers]
  flats = cpu_gemm.matmuls(x.astype(dtype).reshape(rows, size_in), kernels)
  outputs = []
  for layer, flat in zip(layers, flats):
    y = flat.reshape(batch_shape + layer.out_shape)
    outputs.append(y if layer.bias is None else y + layer.bias[...].astype(dtype))
  return tuple(outputs)
