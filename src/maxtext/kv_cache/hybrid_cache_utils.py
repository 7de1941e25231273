"""Honor the runner's `layer_name_to_kvcache_index`: resolve it, gather caches in layer order, scatter them back.

tpu-inference allocates one physical cache per slot in its own order (recurrent GDN/Mamba states first, then
attention caches; KV-sharing layers point at their source's slot) and tells the model which slot each layer uses
through `layer_name_to_kvcache_index`, passed as a static tuple of `("layer.<i>", slot)` pairs. A model that
indexes `kv_caches[i]` reads another layer's cache. This module turns the map into one slot per layer (validated
with precise errors), builds the layer-ordered view the decoder consumes and writes the decoder's results back
into the runner's physical order.

Everything here is plain Python over whatever objects the runner passes (jax arrays, tracers, tuples of arrays for
recurrent states); nothing inspects array values or calls a JAX op, so the remap adds no operation to the traced
program and works identically inside `jax.jit`.
"""

import logging
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_MAP_NAME = "layer_name_to_kvcache_index"
# [0-9], not \d: \d also matches non-ASCII digits such as "٣".
_LAYER_NAME_RE = re.compile(r"(layer|draft_layer)\.(0|[1-9][0-9]*)")
_DRAFT_PREFIX = "draft_layer"


def layer_name(index: int) -> str:
  """Returns the runner's name of decoder layer `index` (`layer.<index>`), the key used in the map and metadata."""
  return f"layer.{index}"


def parse_layer_name(name: Any, where: str = "layer name") -> int:
  """The layer number of a canonical decoder-layer name `layer.<i>` (no sign, spaces or leading zeros).

  Raises:
    ValueError: `name` is not such a name (a draft layer's name included); the message starts with `where`.
  """
  match = _LAYER_NAME_RE.fullmatch(name) if isinstance(name, str) else None
  if match is None or match.group(1) == _DRAFT_PREFIX:
    raise ValueError(
        f"{where}: a decoder layer name must be 'layer.<i>' with <i> a decimal integer without sign, spaces or"
        f" leading zeros, got {name!r}"
    )
  return int(match.group(2))


def _is_int(value: Any) -> bool:
  """True for Python and NumPy integers; False for bool (a flag, never a slot or a count), floats and arrays."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value: Any) -> str:
  """`type value` for error messages, e.g. `float 3.0`."""
  return f"{type(value).__name__} {value!r}"


def _check_count(value: Any, arg_name: str) -> int:
  """Validates a non-negative integer argument and returns it as an int."""
  if not _is_int(value):
    raise TypeError(f"{arg_name} must be a non-negative int, got {_describe(value)}")
  if value < 0:
    raise ValueError(f"{arg_name} must be a non-negative int, got {value}")
  return int(value)


def _format_layer_ranges(layers: Sequence[int]) -> str:
  """Formats sorted layer numbers compactly: [0, 1, 2, 5, 7, 8] -> `layer.0-2, layer.5, layer.7-8`."""
  parts = []
  start = prev = layers[0]
  for layer in [*layers[1:], None]:
    if layer is not None and layer == prev + 1:
      prev = layer
      continue
    parts.append(layer_name(start) if start == prev else f"layer.{start}-{prev}")
    if layer is not None:
      start = prev = layer
  return ", ".join(parts)


def _iter_entries(layer_name_to_kvcache_index: Any) -> list[tuple[str, Any, Any]]:
  """Returns `(where, name, index)` per entry of a mapping or of a sequence of `(name, index)` pairs."""
  if isinstance(layer_name_to_kvcache_index, Mapping):
    return [(f"{_MAP_NAME}[{name!r}]", name, index) for name, index in layer_name_to_kvcache_index.items()]
  if not isinstance(layer_name_to_kvcache_index, Sequence) or isinstance(layer_name_to_kvcache_index, (str, bytes)):
    raise TypeError(
        f"{_MAP_NAME} must be a mapping {{name: index}} or a sequence of (name, index) pairs, "
        f"got {_describe(layer_name_to_kvcache_index)}"
    )
  entries = []
  for position, pair in enumerate(layer_name_to_kvcache_index):
    if not isinstance(pair, Sequence) or isinstance(pair, (str, bytes)) or len(pair) != 2:
      raise TypeError(f"{_MAP_NAME} entry {position} must be a (name, index) pair, got {_describe(pair)}")
    entries.append((f"{_MAP_NAME} entry {position} {tuple(pair)!r}", pair[0], pair[1]))
  return entries


def resolve_layer_kv_cache_indices(
    layer_name_to_kvcache_index: Mapping[str, int] | Sequence[tuple[str, int]], num_layers: int, num_kv_caches: int
) -> tuple[int, ...]:
  """Resolves the runner's layer -> slot map into the slot of every decoder layer.

  Several layers may share a slot (KV sharing), so `num_kv_caches` may be smaller than `num_layers`; slots no
  layer uses are allowed (the runner may hold caches for a drafter). Entries named `draft_layer.<i>` belong to a
  drafter model and are type-checked, then ignored.

  Args:
    layer_name_to_kvcache_index: `{"layer.<i>": slot}`, or the runner's static tuple of `("layer.<i>", slot)`
      pairs. Names use canonical decimal layer numbers (`layer.3`, never `layer.03`); slots are Python or NumPy
      integers (not bool, not float).
    num_layers: number of decoder layers; every `layer.<i>` for i in [0, num_layers) must appear exactly once.
    num_kv_caches: length of the runner's physical `kv_caches` list; every slot must lie in [0, num_kv_caches).

  Returns:
    `slots` with `slots[i]` the index into `kv_caches` of layer i.  # [L]

  Raises:
    TypeError: the map is neither a mapping nor a sequence of pairs, an entry is not a pair, a name is not a str,
      a slot is not an integer, or a count is not an int.
    ValueError: a malformed name, a layer number outside [0, num_layers), a duplicated name, a slot outside
      [0, num_kv_caches), a negative count, an empty map, or missing layers (all of them are listed).
  """
  num_layers = _check_count(num_layers, "num_layers")
  num_kv_caches = _check_count(num_kv_caches, "num_kv_caches")
  entries = _iter_entries(layer_name_to_kvcache_index)
  if not entries and num_layers > 0:
    raise ValueError(
        f"{_MAP_NAME} is empty but the model has {num_layers} layers; it must map every layer.<i>, "
        f"i in [0, {num_layers}), to a kv_caches slot"
    )

  slots: dict[int, int] = {}
  seen_names: set[str] = set()
  for where, name, index in entries:
    if not isinstance(name, str):
      raise TypeError(f"{where}: layer name must be a str such as 'layer.0', got {_describe(name)}")
    match = _LAYER_NAME_RE.fullmatch(name)
    if match is None:
      raise ValueError(
          f"{where}: layer name must be 'layer.<i>' or 'draft_layer.<i>' with <i> a decimal integer without sign, "
          f"spaces or leading zeros, got {name!r}"
      )
    if not _is_int(index):
      raise TypeError(f"{where}: kv_caches index of {name} must be an int, got {_describe(index)}")
    if name in seen_names:
      raise ValueError(f"{where}: {name} appears more than once; each layer must have exactly one slot")
    seen_names.add(name)
    if match.group(1) == _DRAFT_PREFIX:
      continue
    layer = int(match.group(2))
    if layer >= num_layers:
      raise ValueError(
          f"{where}: {name} is not a layer of this model; layer numbers must be in [0, {num_layers}) "
          f"(num_layers={num_layers})"
      )
    if not 0 <= index < num_kv_caches:
      raise ValueError(
          f"{where}: kv_caches index of {name} must be in [0, {num_kv_caches}) (num_kv_caches={num_kv_caches}), "
          f"got {index}"
      )
    slots[layer] = int(index)

  missing = [layer for layer in range(num_layers) if layer not in slots]
  if missing:
    raise ValueError(
        f"{_MAP_NAME} must map every layer.<i>, i in [0, {num_layers}), to a kv_caches slot; "
        f"{len(missing)} of {num_layers} layers are missing: {_format_layer_ranges(missing)}"
    )
  layer_indices = tuple(slots[layer] for layer in range(num_layers))
  # Runs once per trace (the map is static), so this costs nothing per step.
  logger.debug("%s: %d layers -> %d kv_caches slots %s", _MAP_NAME, num_layers, num_kv_caches, layer_indices)
  return layer_indices


def _check_layer_indices(layer_indices: Sequence[int], num_kv_caches: int) -> None:
  """Validates that every layer's slot is an integer inside the physical `kv_caches` list."""
  for layer, slot in enumerate(layer_indices):
    if not _is_int(slot):
      raise TypeError(f"layer_indices[{layer}] ({layer_name(layer)}) must be an int slot, got {_describe(slot)}")
    if not 0 <= slot < num_kv_caches:
      raise ValueError(
          f"{layer_name(layer)} uses kv_caches[{slot}], but kv_caches has {num_kv_caches} entries; "
          f"slots must be in [0, {num_kv_caches})"
      )


def gather_layer_kv_caches(kv_caches: Sequence[Any], layer_indices: Sequence[int]) -> list[Any]:
  """Returns the caches in layer order: element i is `kv_caches[layer_indices[i]]` (the same object).

  Args:
    kv_caches: the runner's physical list; each element is an attention cache array
      (`# [N, bs, 2Hkv/pk, pk, D]`) or a recurrent state tuple (`(conv # [M, K-1, C], ssm # [M, nv, dk, dv])`).
    layer_indices: slot of every layer, as returned by `resolve_layer_kv_cache_indices`.  # [L]

  Returns:
    The layer-ordered list, length `len(layer_indices)`. Layers sharing a slot receive the same object.

  Raises:
    TypeError: a slot is not an integer.
    ValueError: a slot lies outside `kv_caches`.
  """
  _check_layer_indices(layer_indices, len(kv_caches))
  return [kv_caches[slot] for slot in layer_indices]


def _is_unchanged(returned: Any, given: Any) -> bool:
  """True if `returned` is `given`, or a tuple of the same type whose elements are each unchanged.

  Recurrent states are tuples; a layer that rebuilds the tuple around the very arrays it received has not
  written anything, so it must not count as a writer.
  """
  if returned is given:
    return True
  return (
      isinstance(returned, tuple)
      and type(returned) is type(given)
      and len(returned) == len(given)
      and all(_is_unchanged(r, g) for r, g in zip(returned, given))
  )


def scatter_layer_kv_caches(
    kv_caches: Sequence[Any], updated_layer_caches: Sequence[Any], layer_indices: Sequence[int]
) -> list[Any]:
  """Writes the layers' updated caches back into the runner's physical order.

  Changes are detected by identity, never by value (values may be tracers): a layer changed its slot if it
  returned an object other than `kv_caches[slot]`. A returned tuple (recurrent state) counts as unchanged when
  it has the same length and each element `is` the original element (recursively for nested tuples). Slots that
  no layer changed keep the very object passed in, which preserves buffer donation and output shardings.

  Several layers may share a slot (KV sharing). At most one distinct new object may be returned for a slot:
  readers return what they were given (or the writer's new object, if the decoder forwards it), and exactly that
  object is written. Two different new objects for one slot would silently lose one write, so they raise.

  Args:
    kv_caches: the runner's physical list, as passed to the model.
    updated_layer_caches: the cache each layer returned, in layer order.  # [L]
    layer_indices: slot of every layer, as returned by `resolve_layer_kv_cache_indices`.  # [L]

  Returns:
    A new list with the same length and order as `kv_caches`.

  Raises:
    TypeError: a slot is not an integer.
    ValueError: the lengths of `updated_layer_caches` and `layer_indices` differ, a slot lies outside
      `kv_caches`, or layers sharing a slot returned different new objects.
  """
  if len(updated_layer_caches) != len(layer_indices):
    raise ValueError(
        f"updated_layer_caches must have one cache per layer: got {len(updated_layer_caches)} caches for "
        f"{len(layer_indices)} layer_indices"
    )
  _check_layer_indices(layer_indices, len(kv_caches))

  result = list(kv_caches)
  writers: dict[int, list[int]] = {}  # slot -> layers that returned a distinct new object for it
  for layer, (slot, cache) in enumerate(zip(layer_indices, updated_layer_caches)):
    if _is_unchanged(cache, kv_caches[slot]):
      continue
    slot_writers = writers.setdefault(slot, [])
    if any(_is_unchanged(cache, updated_layer_caches[writer]) for writer in slot_writers):
      continue  # The writer's new object, forwarded to a layer sharing its slot.
    slot_writers.append(layer)
    result[slot] = cache

  conflicts = [
      f"kv_caches[{slot}] by {', '.join(layer_name(layer) for layer in layers)}"
      for slot, layers in writers.items()
      if len(layers) > 1
  ]
  if conflicts:
    raise ValueError(
        "at most one layer may write a shared kv_caches slot (the others must return the object they were "
        f"given or the writer's object), but different new caches were returned for {'; '.join(conflicts)}"
    )
  return result


def check_shared_slot_writers(
    layer_indices: Sequence[int], layer_groups: Sequence[int], kv_sharing: Sequence[bool]
) -> None:
  """Checks that the layers writing one physical slot never write the same blocks.

  tpu-inference lets layers of different KV-cache groups share one array (a 5:1 sliding:full model gets one array
  per position within its groups): each layer writes the blocks its own group's block table names, so the writes
  are disjoint and the decoder threads the array through them in layer order. Two writing layers of the same
  group on one slot would write the same blocks, one overwriting the other: that is refused. KV-sharing layers
  only read their source's slot and never conflict.

  Args:
    layer_indices: the slot of every layer (`resolve_layer_kv_cache_indices`).  # [L]
    layer_groups: the KV-cache group of every layer (layers with the same attention metadata share one).  # [L]
    kv_sharing: whether each layer reads another layer's cache instead of writing its own.  # [L]

  Raises:
    ValueError: the sequences differ in length, or two writing layers of one group share a slot (all such slots
      are listed, with their layers and group).
  """
  if not len(layer_indices) == len(layer_groups) == len(kv_sharing):
    raise ValueError(
        f"layer_indices ({len(layer_indices)}), layer_groups ({len(layer_groups)}) and kv_sharing "
        f"({len(kv_sharing)}) must have one entry per layer"
    )
  writers: dict[tuple[int, int], list[int]] = {}
  for layer, (slot, group, reads_only) in enumerate(zip(layer_indices, layer_groups, kv_sharing)):
    if not reads_only:
      writers.setdefault((slot, group), []).append(layer)
  conflicts = [
      f"kv_caches[{slot}] by {', '.join(layer_name(layer) for layer in layers)} (KV-cache group {group})"
      for (slot, group), layers in writers.items()
      if len(layers) > 1
  ]
  if conflicts:
    raise ValueError(
        "layers of one KV-cache group write the same blocks, so they cannot share a kv_caches slot (only layers of"
        f" different groups, or KV-sharing readers, may), but {'; '.join(conflicts)} would"
    )
