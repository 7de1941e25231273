"""Save and restore model parameters as an Orbax checkpoint directory.

The checkpoint holds the canonical parameters (docs/architecture.md) as a nested dict split on "." (`layers` -> `0` ->
`attn` -> `q` -> `kernel`), so Orbax's own array names are the canonical names. Restoring checks every name, shape
and dtype against the model before any array is read (Orbax itself would silently restore a mis-shaped array).

    save_params("/ckpt/params", model)                 # or a {name: array} mapping
    model = restore_model("/ckpt/params", cfg)
"""

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from maxtext.models import Transformer, abstract_model, assign_params, get_flat_params

logger = logging.getLogger(__name__)

_MAX_LISTED = 5


def _listing(names: list[str]) -> str:
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _describe(shape: Any, dtype: Any) -> str:
  return f"{tuple(shape)} {np.dtype(dtype).name}"


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """{"a.b.c": x} -> {"a": {"b": {"c": x}}}."""
  tree: dict[str, Any] = {}
  for name, value in flat.items():
    *parents, leaf = name.split(".")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ValueError(f"parameter name {name!r} collides with another parameter named by its prefix")
    if leaf in node:
      raise ValueError(f"parameter name {name!r} collides with another parameter")
    node[leaf] = value
  return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      yield from _flatten(value, name + ".")
    else:
      yield name, value


def save_params(directory: str | os.PathLike, params: nnx.Module | Mapping[str, Any], *, overwrite: bool = False) -> str:
  """Writes the parameters of a model (or a {canonical name: array} mapping) to an Orbax checkpoint.

  Args:
    directory: the checkpoint directory to create.
    params: a model, or canonical name -> array (numpy or JAX).
    overwrite: replace an existing directory instead of failing.

  Returns:
    The absolute checkpoint path.

  Raises:
    FileExistsError: the directory exists and `overwrite` is False.
    ValueError: an empty parameter set or colliding names.
  """
  path = os.path.abspath(os.fspath(directory))
  flat = get_flat_params(params) if isinstance(params, nnx.Module) else dict(params)
  if not flat:
    raise ValueError("save_params needs at least one parameter, got none")
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"Orbax checkpoint directory {path!r} already exists (pass overwrite=True to replace it)")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, _nest(flat), force=overwrite)
  checkpointer.wait_until_finished()
  logger.info("saved %d parameters to %s", len(flat), path)
  return path


def checkpoint_param_shapes(directory: str | os.PathLike) -> dict[str, jax.ShapeDtypeStruct]:
  """Canonical name -> shape and dtype of every array in an Orbax parameter checkpoint (reads metadata only).

  Raises:
    FileNotFoundError: the directory does not exist.
    ValueError: the directory is not an Orbax checkpoint.
  """
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Orbax checkpoint directory {path!r} does not exist")
  metadata = ocp.StandardCheckpointer().metadata(path).item_metadata
  tree = getattr(metadata, "tree", None)
  if not isinstance(tree, Mapping) or not tree:
    raise ValueError(f"{path!r} is not an Orbax parameter checkpoint (no array metadata found)")
  return {name: jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype) for name, meta in _flatten(tree)}


def restore_params(
    directory: str | os.PathLike,
    expected: Mapping[str, jax.ShapeDtypeStruct],
    *,
    cast_dtype: bool = False,
) -> dict[str, jax.Array]:
  """Restores the parameters of an Orbax checkpoint after checking them against `expected`.

  Args:
    directory: the checkpoint directory.
    expected: canonical name -> shape/dtype (and optionally sharding) the caller needs, e.g. `flat_param_shapes`.
    cast_dtype: restore floating arrays in the expected dtype instead of rejecting a dtype mismatch.

  Returns:
    Canonical name -> JAX array (placed by the expected sharding, else on the default device).

  Raises:
    FileNotFoundError: the directory does not exist.
    ValueError: not a checkpoint, or missing / unexpected names, or a shape mismatch (naming the parameter).
    TypeError: a dtype mismatch when `cast_dtype` is False.
  """
  path = os.path.abspath(os.fspath(directory))
  stored = checkpoint_param_shapes(path)
  missing = sorted(set(expected) - set(stored))
  if missing:
    raise ValueError(f"Orbax checkpoint {path!r} lacks {len(missing)} parameters the model needs: {_listing(missing)}")
  unexpected = sorted(set(stored) - set(expected))
  if unexpected:
    raise ValueError(
        f"Orbax checkpoint {path!r} has {len(unexpected)} parameters the model does not have: {_listing(unexpected)}"
    )
  default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {}
  for name, want in expected.items():
    have = stored[name]
    if tuple(have.shape) != tuple(want.shape):
      raise ValueError(
          f"parameter {name!r}: Orbax checkpoint {path!r} has {_describe(have.shape, have.dtype)}, "
          f"the model expects {_describe(want.shape, want.dtype)}"
      )
    if np.dtype(have.dtype) != np.dtype(want.dtype) and not cast_dtype:
      raise TypeError(
          f"parameter {name!r}: Orbax checkpoint {path!r} has dtype {np.dtype(have.dtype).name}, the model expects "
          f"{np.dtype(want.dtype).name} (set weight_dtype={np.dtype(have.dtype).name} or pass cast_dtype=True)"
      )
    sharding = getattr(want, "sharding", None) or default_sharding
    target[name] = jax.ShapeDtypeStruct(tuple(want.shape), want.dtype, sharding=sharding)
  restored = ocp.StandardCheckpointer().restore(path, _nest(target))
  return dict(_flatten(restored))


def restore_model(
    directory: str | os.PathLike, cfg: ml_collections.FrozenConfigDict, *, cast_dtype: bool = False
) -> Transformer:
  """Builds the model of `cfg` abstractly and fills it from an Orbax parameter checkpoint (see `restore_params`)."""
  model = abstract_model(cfg)
  expected = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in get_flat_params(model).items()}
  params = restore_params(directory, expected, cast_dtype=cast_dtype)

  def drain() -> Iterator[tuple[str, jax.Array]]:
    while params:
      yield params.popitem()

  assign_params(model, drain())
  logger.info("restored %s parameters from %s", cfg.decoder_block, os.fspath(directory))
  return model
