"""Sharding on a device mesh, MaxText style: logical axes per parameter, rules from the config to mesh axes.

This package's mesh has the axes `data`, `model` and `expert`, sized by `ici_data_parallelism`,
`ici_tensor_parallelism` and `ici_expert_parallelism`; a runner's mesh may lack some of them (tpu-inference's
default mesh has only `data` and `model`), and a missing axis counts as size 1. Every parameter has the logical axes
its module declares beside it (`declare`, read by `declared_axes`); a parameter no module declares is an error
naming it. `logical_axis_rules` (config key, a list of `[logical axis, mesh axis or null]` pairs) maps them onto
mesh axes.
Parameters are created directly sharded (`create_sharded_model`: the initialiser runs under `jax.jit` with the
shardings as its outputs, so no device ever holds a whole parameter it does not own). KV caches take the
runner's shardings (`cache_sharding`): attention `P(data, None, model)` on the packed head axis, Gated DeltaNet conv
`P(data, None, model)` and recurrent `P(data, model, None, None)`.

A mesh axis that does not divide a sharded dimension is an error naming the config key, except for KV heads, which
are replicated when there are fewer of them than the tensor-parallel size (as the runner replicates them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtext.configs.derived import MESH_AXIS_KEYS
from maxtext.configs.errors import ConfigError
from maxtext.kv_cache.cache_spec import AttentionSpec, KVCacheSpec
from maxtext.layers.declarations import Axes, axes_by_name
from maxtext.models.params import assign_params, flat_param_shapes, get_flat_params
from maxtext.models.transformer import Transformer, abstract_model

MESH_KEYS = MESH_AXIS_KEYS
MESH_AXES = tuple(MESH_AXIS_KEYS)
# Logical axes that fall back to replication when the mesh axis does not divide them (the runner replicates KV
# heads up to the tensor-parallel size).
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads"})


def declared_axes(cfg: ml_collections.FrozenConfigDict) -> dict[str, Axes]:
  """`{canonical name: logical axes}` as the model's modules declare them (`Transformer.declare`)."""
  return axes_by_name(Transformer.declare(cfg))


def param_logical_axes(name: str, ndim: int, declared: Mapping[str, Axes]) -> Axes:
  """The logical axes of the parameter with this canonical name, from the declarations.

  Raises:
    ValueError: no module declares the parameter, or its declaration has another rank than the parameter.
  """
  axes = declared.get(name)
  if axes is None:
    raise ValueError(
        f"parameter {name!r} has no declaration: the module that holds it must declare it with its logical axes"
        " (its `declare`, see maxtext.layers.declarations)"
    )
  if len(axes) != ndim:
    raise ValueError(f"parameter {name!r} has rank {ndim} but its declared logical axes are {axes}")
  return axes


def axis_rules(cfg: ml_collections.FrozenConfigDict) -> dict[str, tuple[str, ...]]:
  """`logical_axis_rules` (validated at config load) as `{logical axis: mesh axes}`; an empty tuple replicates."""
  rules: dict[str, tuple[str, ...]] = {}
  for logical, target in cfg.logical_axis_rules:
    rules[logical] = () if target is None else (target,) if isinstance(target, str) else tuple(target)
  return rules


def make_mesh(cfg: ml_collections.FrozenConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
  """The `(data, model, expert)` mesh of `ici_data_parallelism x ici_tensor_parallelism x ici_expert_parallelism`.

  Raises:
    ValueError: the mesh needs more devices than JAX has (naming the keys).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = tuple(int(cfg[MESH_KEYS[axis]]) for axis in MESH_AXES)
  needed = math.prod(sizes)
  if needed > len(devices):
    # Slicing the device list would silently build a smaller mesh than asked for.
    keys = " x ".join(f"{MESH_KEYS[a]}={s}" for a, s in zip(MESH_AXES, sizes) if s > 1)
    raise ValueError(
        f"{keys} needs {needed} devices, but JAX sees {len(devices)} ({devices[0].platform}); lower the parallelism"
    )
  return Mesh(np.array(devices[:needed]).reshape(sizes), MESH_AXES)


def axis_size(mesh: Mesh, axis: str) -> int:
  """The size of `axis` in `mesh`; an axis the mesh does not have has size 1 (the runner's own mesh may have only
  `data` and `model`)."""
  return int(mesh.shape.get(axis, 1))


def _mesh_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return math.prod(axis_size(mesh, a) for a in axes)


def partition_spec(
    name: str, shape: Sequence[int], logical: Sequence[str | None], rules: Mapping[str, tuple[str, ...]], mesh: Mesh
) -> PartitionSpec:
  """The mesh partitioning of one array from its logical axes.

  Raises:
    ConfigError: a sharded dimension is not divisible by its mesh axes (naming the parallelism keys).
  """
  spec: list[Any] = []
  used: set[str] = set()
  for dim, axis in zip(shape, logical):
    mesh_axes = tuple(a for a in rules.get(axis, ()) if a not in used and axis_size(mesh, a) > 1) if axis else ()
    size = _mesh_size(mesh, mesh_axes)
    if size > 1 and dim % size:
      if axis in REPLICATE_IF_INDIVISIBLE:
        spec.append(None)
        continue
      keys = ", ".join(f"{MESH_KEYS[a]}={axis_size(mesh, a)}" for a in mesh_axes)
      raise ConfigError(
          f"{keys}: {name} has {dim} along its {axis!r} axis, which must be divisible by {size} to shard over"
          f" {'/'.join(mesh_axes)}; choose a parallelism that divides it"
      )
    used.update(mesh_axes)
    spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*spec)


def param_shardings(cfg: ml_collections.FrozenConfigDict, mesh: Mesh) -> dict[str, NamedSharding]:
  """`{canonical name: NamedSharding}` of every parameter of the model of `cfg` (from shapes only)."""
  rules = axis_rules(cfg)
  declared = declared_axes(cfg)
  out = {}
  for name, leaf in flat_param_shapes(cfg).items():
    axes = param_logical_axes(name, len(leaf.shape), declared)
    out[name] = NamedSharding(mesh, partition_spec(name, leaf.shape, axes, rules, mesh))
  return out


def create_sharded_model(cfg: ml_collections.FrozenConfigDict, mesh: Mesh, rng_key: jax.Array) -> Transformer:
  """The randomly initialised model (`Transformer(cfg, rngs=nnx.Rngs(params=rng_key))`) with every parameter
  created in its sharding: the initialiser runs under `jax.jit` with the shardings as its outputs."""
  shardings = param_shardings(cfg, mesh)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init(key: jax.Array) -> dict[str, jax.Array]:
    return get_flat_params(Transformer(cfg, rngs=nnx.Rngs(params=key)))

  model = abstract_model(cfg)
  assign_params(model, init(rng_key))
  return model


def shard_model(model: Transformer, cfg: ml_collections.FrozenConfigDict, mesh: Mesh) -> Transformer:
  """Places a loaded model's parameters in their shardings, one parameter at a time (in place; returns it)."""
  shardings = param_shardings(cfg, mesh)
  assign_params(model, ((name, jax.device_put(value, shardings[name])) for name, value in get_flat_params(model).items()))
  return model


def cache_sharding(spec: KVCacheSpec, shape: Sequence[int], mesh: Mesh, where: str) -> NamedSharding:
  """The runner's sharding of one physical cache array.

  Attention `[N, bs, packed heads, pk, D]`: `P(data, None, (model, expert))`; recurrent arrays shard their first
  per-slot axis that the model axis divides (Gated DeltaNet: conv channels `P(data, None, model)`, recurrent heads
  `P(data, model, None, None)`), else stay replicated past the slot axis.

  Raises:
    ConfigError: an attention cache's packed head axis is not divisible by the tensor-parallel size.
  """
  data = "data" if axis_size(mesh, "data") > 1 else None
  if isinstance(spec, AttentionSpec):
    head_axes = tuple(a for a in ("model", "expert") if axis_size(mesh, a) > 1)
    size = _mesh_size(mesh, head_axes)
    if size > 1 and shape[2] % size:
      keys = f"ici_tensor_parallelism={axis_size(mesh, 'model')}"
      if axis_size(mesh, "expert") > 1:
        keys += f" x ici_expert_parallelism={axis_size(mesh, 'expert')} (the runner shards cache heads over both)"
      raise ConfigError(f"{keys}: {where} has {shape[2]} packed KV heads, which must be divisible by {size}")
    heads = None if not head_axes else head_axes[0] if len(head_axes) == 1 else head_axes
    return NamedSharding(mesh, PartitionSpec(data, None, heads))
  model = axis_size(mesh, "model")
  spec_axes: list[Any] = [data] + [None] * (len(shape) - 1)
  if model > 1:
    for axis in (2, 1) if len(shape) == 3 else (1,):
      if shape[axis] % model == 0:
        spec_axes[axis] = "model"
        break
  return NamedSharding(mesh, PartitionSpec(*spec_axes))


def per_device_param_bytes(cfg: ml_collections.FrozenConfigDict, mesh: Mesh) -> int:
  """Bytes of parameters one device holds under `mesh` (shapes only: works for real sizes)."""
  total = 0
  shapes = flat_param_shapes(cfg)
  for name, sharding in param_shardings(cfg, mesh).items():
    leaf = shapes[name]
    total += math.prod(sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
  return total
