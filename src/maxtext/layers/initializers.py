"""Fast deterministic random initialisation for dummy weights.

`jax.random` (threefry) costs a fresh, slow XLA compilation per distinct parameter shape on CPU, which would
dominate building small models in tests. Here each parameter is drawn from a counter-based integer hash keyed
by the module's `nnx.Rngs` stream: a few elementwise ops compiled once per shape, equally cheap inside `jax.jit` /
`nnx.eval_shape`, and still a deterministic function of the seed.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_SQRT3 = math.sqrt(3.0)


def _mix32(x: jax.Array) -> jax.Array:
  """An avalanching 32-bit integer hash (xor-shift-multiply)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std", "mean"))
def _hash_uniform(key: jax.Array, *, shape: tuple[int, ...], dtype: np.dtype, std: float, mean: float) -> jax.Array:
  """Uniform values with the given mean and std, one hash per element counter, keyed by the words of `key`."""
  words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  seed = jnp.uint32(0x243F6A88)
  for i in range(words.shape[0]):
    seed = _mix32(seed ^ words[i])
  counter = jnp.arange(math.prod(shape), dtype=jnp.uint32)
  bits = _mix32(_mix32(counter * jnp.uint32(0x9E3779B9) + seed) ^ (seed >> 7))
  unit = ((bits >> 8).astype(jnp.float32) + 0.5) * (2.0 / (1 << 24)) - 1.0  # (-1, 1), symmetric
  return (unit * (_SQRT3 * std) + mean).reshape(shape).astype(dtype)


class ShapeOnlyRngs:
  """Stands in for `nnx.Rngs` when a model is built for its shapes only (`abstract_model`).

  The initializers below then return `jax.ShapeDtypeStruct`s instead of arrays: the model is built without a trace
  and without a JAX operation (its draws are None), which makes building the structure of a large model cheap.
  """


Init = jax.Array | jax.ShapeDtypeStruct  # a parameter's initial value, or only its shape and dtype


def constant(rngs: nnx.Rngs | ShapeOnlyRngs | None, shape: tuple[int, ...], dtype: jnp.dtype, value: float) -> Init:
  """`shape` filled with `value` in `dtype`; only its shape and dtype under `ShapeOnlyRngs`."""
  shape = tuple(int(s) for s in shape)
  if isinstance(rngs, ShapeOnlyRngs):
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))
  return jnp.full(shape, value, dtype)


def computed(
    rngs: nnx.Rngs | ShapeOnlyRngs, shape: tuple[int, ...], dtype: jnp.dtype, make: Callable[[], jax.Array]
) -> Init:
  """`make()` (an array of `shape` and `dtype`); only that shape and dtype under `ShapeOnlyRngs`, without calling it.

  Raises:
    ValueError: `make()` returned another shape or dtype.
  """
  if isinstance(rngs, ShapeOnlyRngs):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))
  value = make()
  if value.shape != tuple(shape) or value.dtype != np.dtype(dtype):
    raise ValueError(
        f"an initializer made {value.shape} {value.dtype}, its parameter is {tuple(shape)} {np.dtype(dtype)}"
    )
  return value


def draw_key(rngs: nnx.Rngs | ShapeOnlyRngs) -> jax.Array | None:
  """Next key of the `params` stream, computed eagerly when the stream is concrete; None for `ShapeOnlyRngs`.

  Under `nnx.eval_shape` / `jax.jit`, every traced update of the stream's counter makes flax walk the whole
  trace (quadratic in the number of parameters, so the largest configs would spend most of their build there).
  Drawing the key at compile time keeps the counter concrete; with a traced stream (an `Rngs` passed into `jit`) it
  is traced as usual.
  """
  if isinstance(rngs, ShapeOnlyRngs):
    return None
  with jax.ensure_compile_time_eval():
    return rngs.params()


def uniform(key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype, std: float, mean: float = 0.0) -> Init:
  """Uniform random values with the given mean and standard deviation.

  Args:
    key: a JAX PRNG key (e.g. `draw_key(rngs)`); its words seed the hash. None (`ShapeOnlyRngs`): only the shape
      and dtype.
    shape: result shape (fewer than 2**32 elements).
    dtype: result dtype.
    std: standard deviation.
    mean: mean.

  Returns:
    `shape` array in `dtype` (a `jax.ShapeDtypeStruct` without a key).
  """
  shape = tuple(int(s) for s in shape)
  if math.prod(shape) >= 2**32:
    raise ValueError(f"cannot initialise a parameter of {math.prod(shape)} elements (limit 2**32), shape {shape}")
  if key is None:
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))
  return _hash_uniform(key, shape=shape, dtype=np.dtype(dtype), std=float(std), mean=float(mean))


def fan_in_uniform(key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> Init:
  """Zero-mean uniform values with variance `1 / fan_in` (LeCun scaling)."""
  return uniform(key, shape, dtype, 1.0 / math.sqrt(fan_in))
