"""Parameters declare themselves: each module names its parameters with their logical axes and the checkpoint
tensors that fill them.

A module (a mixer, the MLP, the MoE, the decoder layer, the transformer) has a classmethod `declare(...)` returning
`ParamDecl`s: the parameter's name relative to the module (`q.kernel`), its logical axes (one per dimension, which
`logical_axis_rules` maps onto the mesh: `models/sharding.py`), and its `Source`: the Hugging Face tensors (named
relative to the module's checkpoint prefix) and how they are re-laid-out (`tensor_sources.py`). A source may fill
several parameters (a fused projection split in parts); each parameter names the part it is. A parent module
nests its children's declarations under its own prefixes (`nest`), so the model's declarations carry canonical
and checkpoint names, from which the checkpoint mapping (`recipes`) and the shardings are read.

    ParamDecl("q.kernel", ("embed", "heads", "head_dim"), heads_in("self_attn.q_proj.weight", hq, dh, d))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence

from maxtext.layers.tensor_sources import Recipe, Source

Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class ParamDecl:
  """One parameter as its module declares it.

  Attributes:
    name: the parameter's name relative to the declaring module (`q.kernel`; canonical once nested to the top).
    axes: its logical axes, one per dimension (None: never sharded).
    source: the checkpoint tensors that fill it, or None for a parameter no checkpoint format holds.
    part: which output of `source` it is (a source that splits one tensor fills several parameters).
  """

  name: str
  axes: Axes
  source: Source | None = None
  part: int = 0


class StoredTensors:
  """The tensor names a checkpoint holds, as one module sees them: `name in stored` asks for `prefix + name`.

  Some layouts depend on which tensors a checkpoint holds (experts one by one or fused); the modules that have such
  layouts ask their view, relative to their own checkpoint prefix. With no names (shardings, shapes), every module
  declares its default layout.
  """

  def __init__(self, names: Collection[str] = (), prefix: str = ""):
    self._names = names
    self.prefix = prefix

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and self.prefix + name in self._names

  def under(self, prefix: str) -> StoredTensors:
    """The view of a child module whose checkpoint names sit under `prefix`."""
    return StoredTensors(self._names, self.prefix + prefix)


def nest(decls: Iterable[ParamDecl], prefix: str, checkpoint_prefix: str = "") -> list[ParamDecl]:
  """A child module's declarations as its parent sees them: names under `prefix`, checkpoint tensors under
  `checkpoint_prefix`. Parameters that shared a source still share one (moved) source."""
  moved: dict[int, Source] = {}
  out = []
  for decl in decls:
    source = decl.source
    if source is not None and checkpoint_prefix:
      if id(source) not in moved:
        moved[id(source)] = source.under(checkpoint_prefix)
      source = moved[id(source)]
    out.append(ParamDecl(prefix + decl.name, decl.axes, source, decl.part))
  return out


def axes_by_name(decls: Iterable[ParamDecl]) -> dict[str, Axes]:
  """`{name: logical axes}` of the declarations.

  Raises:
    ValueError: a name is declared twice.
  """
  axes: dict[str, Axes] = {}
  for decl in decls:
    if decl.name in axes:
      raise ValueError(f"parameter {decl.name!r} is declared twice")
    axes[decl.name] = decl.axes
  return axes


def recipes(decls: Sequence[ParamDecl]) -> list[Recipe]:
  """The checkpoint recipes of the declarations: one per source, in the order of their first parameter, each with
  its parameters as targets in part order.

  Raises:
    NotImplementedError: a parameter has no checkpoint source, or its source is a layout this package refuses.
    ValueError: a source's outputs are not each declared exactly once.
  """
  groups: dict[int, tuple[Source, dict[int, str]]] = {}
  for decl in decls:
    if decl.source is None:
      raise NotImplementedError(
          f"parameter {decl.name!r} has no checkpoint source: its module declares no Hugging Face tensor for it"
      )
    if decl.source.refusal:
      raise NotImplementedError(decl.source.refusal)
    source, parts = groups.setdefault(id(decl.source), (decl.source, {}))
    if decl.part in parts or not 0 <= decl.part < len(source.outputs):
      raise ValueError(
          f"parameter {decl.name!r} is part {decl.part} of a source with {len(source.outputs)} outputs"
          f" ({', '.join(source.tensors)}), which must each be declared once"
      )
    parts[decl.part] = decl.name
  out = []
  for source, parts in groups.values():
    if len(parts) != len(source.outputs):
      raise ValueError(
          f"{', '.join(source.tensors)} make {len(source.outputs)} parameters but only {sorted(parts.values())} are"
          " declared"
      )
    targets = tuple((parts[j], shape) for j, shape in enumerate(source.outputs))
    out.append(Recipe(source.tensors, source.shapes, targets, source.convert))
  return out
