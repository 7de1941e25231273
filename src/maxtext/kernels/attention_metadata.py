"""The runner's per-step attention metadata as JAX pytrees (docs/runner-contract.md).

`AttentionMetadata` describes one ragged batch for one KV-cache group. With more than one group (hybrid models:
sliding-window and full-attention layers, or recurrent layers) the runner passes a `GroupedAttentionMetadata`, a
`{layer_name: AttentionMetadata}` dict whose pytree holds one `AttentionMetadata` per group, so a jit round trip
gives every layer of a group the very same object and per-group derived values are computed once.
"""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import jax

from maxtext.kernels import ragged_batch


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class AttentionMetadata:
  """One step's batch description for one KV-cache group (all arrays int32).

  Attributes:
    input_positions: `[T]` token positions, or `[3, T]` for MRoPE; the padded tail holds stale values.
    block_tables: `[max_num_reqs * max_blocks_per_req]` flat block table, row-major per request, 0-padded; None
      for pooling models.
    seq_lens: `[max_num_reqs]` KV length per request after this step; 0 for padded requests.
    query_start_loc: `[max_num_reqs + 1]` cumulative new-token counts; the tail repeats the total.
    request_distribution: `[3]` `(num_decode, num_decode, num_reqs)`; decodes come first.
    mamba_state_indices: `[max_num_reqs]` recurrent state slot per request, or None without recurrent layers and
      under prefix caching's "align" scheme (the recurrent group's block table names the state blocks; see
      `recurrent_state_indices`).
    padded_num_reqs: static bucketed request count (a jit cache key).
  """

  input_positions: jax.Array
  block_tables: jax.Array | None
  seq_lens: jax.Array
  query_start_loc: jax.Array
  request_distribution: jax.Array
  mamba_state_indices: jax.Array | None = None
  padded_num_reqs: int

  def __post_init__(self):
    # Only the static field is checked here: unflattening may put non-array leaves in the data fields.
    if isinstance(self.padded_num_reqs, bool) or not isinstance(self.padded_num_reqs, int):
      raise TypeError(f"padded_num_reqs must be an int (it is static); got {self.padded_num_reqs!r}")
    if self.padded_num_reqs < 0:
      raise ValueError(f"padded_num_reqs must be >= 0; got {self.padded_num_reqs}")

  @property
  def max_num_reqs(self) -> int:
    """Request rows of the batch arrays (`seq_lens.shape[0]`)."""
    return self.seq_lens.shape[0]

  def validate(self) -> None:
    """Checks that the array shapes agree with each other (static; works on tracers).

    Raises:
      ValueError: a shape disagrees with `seq_lens` `[max_num_reqs]`; the message names the field.
    """
    num_reqs = self.seq_lens.shape[0] if self.seq_lens.ndim == 1 else -1
    if num_reqs < 1:
      raise ValueError(
          f"AttentionMetadata.seq_lens must be [max_num_reqs] with max_num_reqs >= 1; got {self.seq_lens.shape}"
      )
    normalize_positions(self.input_positions)
    if self.query_start_loc.shape != (num_reqs + 1,):
      raise ValueError(
          f"AttentionMetadata.query_start_loc must be [max_num_reqs + 1] = ({num_reqs + 1},); "
          f"got {self.query_start_loc.shape}"
      )
    if self.request_distribution.shape != (3,):
      raise ValueError(f"AttentionMetadata.request_distribution must be [3]; got {self.request_distribution.shape}")
    if self.block_tables is not None and (
        self.block_tables.ndim != 1 or self.block_tables.shape[0] == 0 or self.block_tables.shape[0] % num_reqs
    ):
      raise ValueError(
          f"AttentionMetadata.block_tables must be flat [max_num_reqs * max_blocks_per_req] with max_num_reqs = "
          f"{num_reqs}; got {self.block_tables.shape}"
      )
    if self.mamba_state_indices is not None and self.mamba_state_indices.shape != (num_reqs,):
      raise ValueError(
          f"AttentionMetadata.mamba_state_indices must be [max_num_reqs] = ({num_reqs},); "
          f"got {self.mamba_state_indices.shape}"
      )
    if self.padded_num_reqs > num_reqs:
      raise ValueError(f"AttentionMetadata.padded_num_reqs ({self.padded_num_reqs}) exceeds max_num_reqs ({num_reqs})")


_DATA_FIELDS = (
    "input_positions",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "request_distribution",
    "mamba_state_indices",
)
jax.tree_util.register_dataclass(AttentionMetadata, data_fields=list(_DATA_FIELDS), meta_fields=["padded_num_reqs"])


def normalize_positions(input_positions: jax.Array) -> jax.Array:
  """Returns `[T]` positions from `[T]` or text-only MRoPE `[3, T]` (the 3 streams are equal; stream 0 is used).

  Raises:
    ValueError: any other shape; the message includes the given shape.
  """
  shape = tuple(input_positions.shape)
  if len(shape) == 1:
    return input_positions
  if len(shape) == 2 and shape[0] == 3:
    return input_positions[0]
  raise ValueError(f"input_positions must have shape (T,) or (3, T) for MRoPE; got {shape}")


def _immutable(self, *args, **kwargs) -> NoReturn:
  del args, kwargs
  raise TypeError(
      f"{type(self).__name__} is immutable (its pytree is one AttentionMetadata per group); build a new one from "
      "groups and layer names"
  )


class GroupedAttentionMetadata(dict):
  """`{layer_name: AttentionMetadata}` for several KV-cache groups; the layers of a group share one object.

  Its pytree children are the groups' `AttentionMetadata` (one per group) and the layer names are static aux
  data, so the leaf count is `groups x fields`, not `layers x fields`.
  """

  def __init__(self, groups: Sequence[AttentionMetadata], layer_names_per_group: Sequence[Sequence[str]]):
    """Builds the mapping.

    Args:
      groups: one `AttentionMetadata` per KV-cache group.
      layer_names_per_group: the layer names of each group (same length as `groups`).

    Raises:
      TypeError: a group is not an `AttentionMetadata` or a layer name is not a str.
      ValueError: lengths differ, a group has no layers, or a layer is in two groups.
    """
    groups = tuple(groups)
    names = tuple(tuple(group_names) for group_names in layer_names_per_group)
    if len(groups) != len(names):
      raise ValueError(f"got {len(groups)} metadata groups but {len(names)} lists of layer names")
    seen = {}
    for gid, (md, group_names) in enumerate(zip(groups, names)):
      if not isinstance(md, AttentionMetadata):
        raise TypeError(f"group {gid} must be an AttentionMetadata; got {type(md).__name__}")
      if not group_names:
        raise ValueError(f"group {gid} has no layer names")
      for name in group_names:
        if not isinstance(name, str):
          raise TypeError(f"layer names must be str; group {gid} has {name!r}")
        if name in seen:
          raise ValueError(f"layer {name!r} is in group {seen[name]} and group {gid}")
        seen[name] = gid
    self._fill(groups, names)

  def _fill(self, groups: tuple[Any, ...], names: tuple[tuple[str, ...], ...]) -> None:
    self._groups = groups
    self._layer_names_per_group = names
    for md, group_names in zip(groups, names):
      for name in group_names:
        dict.__setitem__(self, name, md)

  @classmethod
  def _unflatten(cls, names: tuple[tuple[str, ...], ...], groups: Iterable[Any]) -> "GroupedAttentionMetadata":
    # No validation: tree utilities may unflatten with placeholder children.
    obj = cls.__new__(cls)
    obj._fill(tuple(groups), names)  # pylint: disable=protected-access  # own class, alternate constructor
    return obj

  @property
  def groups(self) -> tuple[AttentionMetadata, ...]:
    """One `AttentionMetadata` per group."""
    return self._groups

  @property
  def layer_names_per_group(self) -> tuple[tuple[str, ...], ...]:
    """The layer names of each group."""
    return self._layer_names_per_group

  def __reduce__(self):
    return (type(self), (self._groups, self._layer_names_per_group))

  def __repr__(self) -> str:
    return f"GroupedAttentionMetadata(layer_names_per_group={self._layer_names_per_group!r})"

  __setitem__ = _immutable
  __delitem__ = _immutable
  __ior__ = _immutable
  clear = _immutable
  pop = _immutable
  popitem = _immutable
  setdefault = _immutable
  update = _immutable


jax.tree_util.register_pytree_node(
    GroupedAttentionMetadata,
    lambda md: (md.groups, md.layer_names_per_group),
    GroupedAttentionMetadata._unflatten,  # pylint: disable=protected-access  # the registered unflatten hook
)


def _as_metadata(md: Any, where: str) -> AttentionMetadata:
  """This package's `AttentionMetadata` of one runner metadata object (the object itself when it is one).

  Any object with this package's fields is read by attribute, so tpu-inference's own `AttentionMetadata` (the
  same fields plus `pcp`, `pcp_cache_pages` and `use_causal_mask`) is taken as it is; only what this model cannot
  honour is refused.
  """
  if isinstance(md, AttentionMetadata):
    return md
  missing = [name for name in (*_DATA_FIELDS, "padded_num_reqs") if not hasattr(md, name)]
  if missing:
    raise TypeError(
        f"{where}: attention metadata must be an AttentionMetadata (this package's or tpu-inference's) with the "
        f"fields {', '.join((*_DATA_FIELDS, 'padded_num_reqs'))}; got {type(md).__name__} without {', '.join(missing)}"
    )
  if getattr(md, "pcp", None) is not None:
    raise NotImplementedError(
        f"{where}: attention_metadata.pcp is set (prefill context parallelism), which this model does not support;"
        " run without prefill context parallelism"
    )
  if getattr(md, "use_causal_mask", True) is not True:
    raise NotImplementedError(
        f"{where}: attention_metadata.use_causal_mask is {md.use_causal_mask!r}; this decoder-only model attends"
        " causally only"
    )
  return AttentionMetadata(**{name: getattr(md, name) for name in (*_DATA_FIELDS, "padded_num_reqs")})


def metadata_for_layers(
    attention_metadata: Any, layer_names: Sequence[str], kv_sources: Mapping[str, str] | None = None
) -> list[AttentionMetadata]:
  """The metadata of each layer, as this package's `AttentionMetadata`, keeping the runner's group sharing.

  `attention_metadata` is one metadata object (every layer's) or a `{layer_name: metadata}` mapping (one object
  per KV-cache group, as this package's and tpu-inference's `GroupedAttentionMetadata` hold it). Layers given the
  same object get the same converted object, so a group's derived values are computed once and a layer's group
  can be told by identity. Conversion is attribute reads only: no array is touched. A KV-sharing layer is in no
  group of tpu-inference's (it has no cache of its own): without an entry it takes its source's (`kv_sources`,
  `{layer: source layer}`), whose cache it reads.

  Raises:
    ValueError: the mapping has no entry for a layer (the message lists the known layers).
    TypeError: `attention_metadata` (or a mapping's entry) is not an attention metadata object.
    NotImplementedError: the metadata asks for prefill context parallelism (`pcp`) or a non-causal mask.
  """
  converted: dict[int, AttentionMetadata] = {}

  def convert(md: Any, where: str) -> AttentionMetadata:
    if id(md) not in converted:
      converted[id(md)] = _as_metadata(md, where)
    return converted[id(md)]

  if not isinstance(attention_metadata, Mapping):
    if isinstance(attention_metadata, (str, bytes, Sequence)) or not hasattr(attention_metadata, "seq_lens"):
      raise TypeError(
          "attention_metadata must be an AttentionMetadata or a {layer_name: AttentionMetadata} mapping; "
          f"got {type(attention_metadata).__name__}"
      )
    md = convert(attention_metadata, "attention_metadata")
    return [md] * len(layer_names)
  out = []
  kv_sources = kv_sources or {}
  for name in layer_names:
    key = name if name in attention_metadata else kv_sources.get(name, name)
    if key not in attention_metadata:
      raise ValueError(
          f"no attention metadata for layer {name!r}; the grouped metadata has layers {list(attention_metadata)}"
      )
    out.append(convert(attention_metadata[key], f"attention_metadata[{key!r}]"))
  return out


def recurrent_state_indices(
    md: AttentionMetadata, mamba_block_size: int | None, num_slots: int, where: str
) -> tuple[jax.Array | None, jax.Array]:
  """The state slots a recurrent layer reads its initial state from and writes its final state to.

  Two runner schemes, as tpu-inference has them:
    - compact (no prefix caching): `md.mamba_state_indices` names one slot per request, read and written; the
      read indices are returned as None (the kernels then read where they write);
    - align (prefix caching, `mamba_state_indices` is None): the recurrent group's `md.block_tables` names one
      state block per `mamba_block_size` tokens; read = the block of the last computed token, write = the block
      of the last new token (`ragged_batch.align_state_indices`).

  Args:
    md: the recurrent group's metadata.
    mamba_block_size: tokens per state block (needed by the align scheme only).
    num_slots: rows of the layer's state arrays.
    where: the layer, for messages (e.g. "layer.0 (linear_attention)").

  Returns:
    `(read_state_indices [S] or None, write_state_indices [S])`.

  Raises:
    ValueError: neither `mamba_state_indices` nor block tables are given, or the align scheme has no block size.
  """
  if md.mamba_state_indices is not None:
    return None, md.mamba_state_indices
  if md.block_tables is None:
    raise ValueError(
        f"{where}: a recurrent layer needs attention_metadata.mamba_state_indices (compact state slots) or, under"
        " prefix caching, the recurrent group's block_tables (state blocks); got neither"
    )
  if not mamba_block_size or mamba_block_size < 1:
    raise ValueError(
        f"{where}: the state blocks of the block table need mamba_block_size >= 1 (tokens per state block); got"
        f" {mamba_block_size!r}"
    )
  return ragged_batch.align_state_indices(
      md.block_tables, md.seq_lens, md.query_start_loc, md.request_distribution, int(mamba_block_size), num_slots
  )
