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
    if x.shape[x.ndim - len(self.in_shape) :] != self.in_shape:
      raise ValueError(f"DenseGeneral expects trailing input axes {self.in_shape}, got input shape {x.shape}")
    bias = None if self.bias is None else self.bias[...]
    return dense_general(x, self.kernel[...], bias, num_in_axes=len(self.in_shape), dtype=self.dtype)
