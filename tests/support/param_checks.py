"""Facts about a model's parameters that tests check (the runtime never needs them)."""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from maxtext.models import Transformer, abstract_model, get_flat_params, sharding


def param_count(cfg: ml_collections.FrozenConfigDict) -> int:
  """Number of parameters of the model described by `cfg`, from shapes only."""
  leaves = jax.tree_util.tree_leaves(nnx.state(abstract_model(cfg), nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in leaves)


def params_are_sharded_as_configured(model: Transformer, cfg: ml_collections.FrozenConfigDict, mesh: Mesh) -> bool:
  """Whether every parameter of `model` has the sharding `sharding.param_shardings` gives it."""
  expected = sharding.param_shardings(cfg, mesh)
  return all(
      value.sharding.is_equivalent_to(expected[name], value.ndim) for name, value in get_flat_params(model).items()
  )


def canonical_model(engine: Any) -> Transformer:
  """A copy of an engine's model with every parameter back in the canonical layout (`KernelBackend.restore_params`),
  as the dense full-sequence forward reads it; the engine's own model keeps its backend's layout."""
  model = nnx.clone(engine.model.model)
  engine.backend.restore_params(model)
  return model
