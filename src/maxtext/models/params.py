"""Flat `{canonical name: array}` views of a model's parameters, for checkpoint loaders and tests.

Canonical names are the model's `nnx.state(model, nnx.Param)` paths joined by ".", e.g.
`layers.3.attn.q.kernel`.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from maxtext.models.transformer import abstract_model


def _named_variables(model: nnx.Module) -> dict[str, nnx.Param]:
  """`{canonical name: Param variable}` of a model, in `nnx.state` order."""
  return {".".join(str(p) for p in path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def flat_param_shapes(cfg: ml_collections.FrozenConfigDict) -> dict[str, jax.ShapeDtypeStruct]:
  """Canonical name -> shape and dtype of every parameter of the model for `cfg` (no memory allocated)."""
  return {
      name: jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype)
      for name, var in _named_variables(abstract_model(cfg)).items()
  }


def get_flat_params(model: nnx.Module) -> dict[str, jax.Array]:
  """Canonical name -> parameter array of `model`."""
  return {name: var.get_value() for name, var in _named_variables(model).items()}


def to_device(value: Any, dtype: Any) -> jax.Array:
  """`value` as a device array of `dtype`. A host array (NumPy, a checkpoint's tensor) moves by `jax.device_put`,
  which compiles nothing: `jnp.asarray` compiles a small XLA program for every new shape, a few tenths of a second
  over the shapes of a hybrid checkpoint. A device array keeps its placement (cast only when its dtype differs).
  """
  if isinstance(value, jax.Array):
    return value if value.dtype == dtype else value.astype(dtype)
  return jax.device_put(np.asarray(value, dtype=dtype))


def _describe(value: Any) -> str:
  return f"{tuple(value.shape)} {np.dtype(value.dtype).name}"


def assign_params(
    model: nnx.Module,
    named_arrays: Iterable[tuple[str, Any]] | Mapping[str, Any],
    *,
    cast_dtype: bool = False,
) -> None:
  """Replaces every parameter of `model` from `(canonical name, array)` pairs.

  Each pair is checked and assigned as it arrives (so a streaming loader holds one tensor at a time); on error
  the model may be partly assigned and should be discarded. Works on models from `nnx.eval_shape` as well.

  Args:
    model: the model whose parameters are replaced in place.
    named_arrays: pairs (or a mapping) covering every parameter exactly once.
    cast_dtype: cast floating arrays to the parameter's dtype instead of rejecting a dtype mismatch.

  Raises:
    ValueError: unknown, duplicate or missing names, or a shape mismatch (naming the tensor, expected and given
      shape).
    TypeError: a dtype mismatch when `cast_dtype` is False, or a value that is not an array.
  """
  variables = _named_variables(model)
  items = named_arrays.items() if isinstance(named_arrays, Mapping) else named_arrays
  assigned: set[str] = set()
  for name, value in items:
    if name not in variables:
      raise ValueError(f"unexpected parameter {name!r}: the model has no such tensor")
    if name in assigned:
      raise ValueError(f"parameter {name!r} given more than once")
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
      raise TypeError(f"parameter {name!r}: expected an array, got {type(value).__name__}")
    expected = variables[name].get_value()
    if tuple(value.shape) != tuple(expected.shape):
      raise ValueError(f"parameter {name!r}: expected shape {_describe(expected)}, got {_describe(value)}")
    if np.dtype(value.dtype) != np.dtype(expected.dtype):
      if not cast_dtype:
        raise TypeError(
            f"parameter {name!r}: expected dtype {np.dtype(expected.dtype).name}, got {np.dtype(value.dtype).name}"
            " (pass cast_dtype=True to cast)"
        )
      if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"parameter {name!r}: cannot cast non-floating dtype {np.dtype(value.dtype).name}")
    variables[name].set_value(to_device(value, expected.dtype))
    assigned.add(name)
  missing = [name for name in variables if name not in assigned]
  if missing:
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    raise ValueError(f"{len(missing)} parameters were not given: {shown}")
