"""Tests for AttentionMetadata, GroupedAttentionMetadata and their helpers."""

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels import attention_metadata as am


def _metadata(num_tokens=8, max_reqs=4, blocks_per_req=3, with_mamba=True, padded_num_reqs=4, offset=0):
  return am.AttentionMetadata(
      input_positions=jnp.arange(num_tokens, dtype=jnp.int32) + offset,
      block_tables=jnp.arange(max_reqs * blocks_per_req, dtype=jnp.int32) + offset,
      seq_lens=jnp.full((max_reqs,), 3 + offset, jnp.int32),
      query_start_loc=jnp.arange(max_reqs + 1, dtype=jnp.int32),
      request_distribution=jnp.array([1, 1, 2], jnp.int32),
      mamba_state_indices=jnp.arange(1, max_reqs + 1, dtype=jnp.int32) if with_mamba else None,
      padded_num_reqs=padded_num_reqs,
  )


def test_metadata_is_a_pytree_with_a_static_request_count():
  """Arrays are leaves; padded_num_reqs is static (a jit cache key)."""
  md = _metadata()
  leaves, treedef = jax.tree_util.tree_flatten(md)
  assert len(leaves) == 6
  md2 = jax.tree_util.tree_unflatten(treedef, leaves)
  assert md2.padded_num_reqs == 4 and md2.max_num_reqs == 4
  assert len(jax.tree.leaves(_metadata(with_mamba=False))) == 5

  traces = []

  @jax.jit
  def step(md):
    traces.append(md.padded_num_reqs)
    return md.seq_lens * 2

  np.testing.assert_array_equal(step(md), np.full(4, 6))
  step(_metadata(offset=1))  # same structure and static field: no retrace
  step(_metadata(padded_num_reqs=2))  # another static value: a new trace
  assert traces == [4, 2]


def test_metadata_is_frozen_and_keyword_only():
  """Fields cannot be reassigned and must be passed by name."""
  md = _metadata()
  with pytest.raises(dataclasses.FrozenInstanceError):
    md.seq_lens = md.seq_lens
  with pytest.raises(TypeError):
    am.AttentionMetadata(  # pylint: disable=too-many-function-args,missing-kwoa  # positional on purpose
        md.input_positions, md.block_tables, md.seq_lens, md.query_start_loc, md.request_distribution
    )


@pytest.mark.parametrize(
    "value, error, match",
    [
        (2.0, TypeError, r"padded_num_reqs must be an int \(it is static\); got 2.0"),
        (True, TypeError, "padded_num_reqs must be an int"),
        (-1, ValueError, "padded_num_reqs must be >= 0; got -1"),
    ],
)
def test_metadata_rejects_bad_padded_num_reqs(value, error, match):
  """The static field must be a non-negative int."""
  with pytest.raises(error, match=match):
    _metadata(padded_num_reqs=value)


def test_validate_accepts_consistent_shapes():
  """Optional fields may be None; MRoPE positions are accepted."""
  _metadata().validate()
  _metadata(with_mamba=False).validate()
  dataclasses.replace(_metadata(), block_tables=None).validate()
  dataclasses.replace(_metadata(), input_positions=jnp.zeros((3, 8), jnp.int32)).validate()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("seq_lens", jnp.zeros((0,), jnp.int32), r"seq_lens must be \[max_num_reqs\] with max_num_reqs >= 1; got \(0,\)"),
        ("seq_lens", jnp.zeros((2, 2), jnp.int32), r"seq_lens must be \[max_num_reqs\]"),
        ("input_positions", jnp.zeros((2, 8), jnp.int32), r"got \(2, 8\)"),
        (
            "query_start_loc",
            jnp.zeros((4,), jnp.int32),
            r"query_start_loc must be \[max_num_reqs \+ 1\] = \(5,\); got \(4,\)",
        ),
        ("request_distribution", jnp.zeros((6,), jnp.int32), r"request_distribution must be \[3\]; got \(6,\)"),
        ("block_tables", jnp.zeros((10,), jnp.int32), r"block_tables must be flat .* max_num_reqs = 4; got \(10,\)"),
        ("block_tables", jnp.zeros((4, 3), jnp.int32), r"block_tables must be flat"),
        ("block_tables", jnp.zeros((0,), jnp.int32), r"block_tables must be flat"),
        ("mamba_state_indices", jnp.zeros((3,), jnp.int32), r"mamba_state_indices must be \[max_num_reqs\] = \(4,\)"),
        ("padded_num_reqs", 5, r"padded_num_reqs \(5\) exceeds max_num_reqs \(4\)"),
    ],
)
def test_validate_names_the_bad_field(field, value, match):
  """Each inconsistent shape is reported with its field name."""
  md = dataclasses.replace(_metadata(), **{field: value})
  with pytest.raises(ValueError, match=match):
    md.validate()


def test_normalize_positions():
  """(T,) passes through, (3, T) gives stream 0, anything else raises with the shape."""
  pos = jnp.arange(4, dtype=jnp.int32)
  assert am.normalize_positions(pos) is pos
  np.testing.assert_array_equal(am.normalize_positions(jnp.stack([pos, pos, pos])), np.arange(4))
  with pytest.raises(ValueError, match=r"\(T,\) or \(3, T\) for MRoPE; got \(2, 4\)"):
    am.normalize_positions(jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"got \(\)"):
    am.normalize_positions(jnp.zeros((), jnp.int32))
  with pytest.raises(ValueError, match=r"got \(3, 4, 1\)"):
    am.normalize_positions(jnp.zeros((3, 4, 1), jnp.int32))


def _grouped(with_mamba=True):
  groups = [_metadata(with_mamba=with_mamba), _metadata(with_mamba=with_mamba, blocks_per_req=5, offset=7)]
  names = [["layer.0", "layer.2", "layer.3"], ["layer.1"]]
  return am.GroupedAttentionMetadata(groups, names), groups


def test_grouped_metadata_is_a_layer_mapping_sharing_group_objects():
  """Layers of a group map to the same object."""
  grouped, groups = _grouped()
  assert isinstance(grouped, dict)
  assert list(grouped) == ["layer.0", "layer.2", "layer.3", "layer.1"]
  assert grouped["layer.0"] is grouped["layer.3"] is groups[0]
  assert grouped["layer.1"] is groups[1]
  assert grouped.groups == tuple(groups)
  assert grouped.layer_names_per_group == (("layer.0", "layer.2", "layer.3"), ("layer.1",))
  assert "layer_names_per_group=(('layer.0'" in repr(grouped)


@pytest.mark.parametrize("with_mamba, fields", [(True, 6), (False, 5)])
def test_grouped_metadata_flattens_to_one_metadata_per_group(with_mamba, fields):
  """Leaves are groups x fields, not layers x fields."""
  grouped, _ = _grouped(with_mamba)
  leaves, treedef = jax.tree_util.tree_flatten(grouped)
  assert len(leaves) == 2 * fields  # groups x fields, not layers x fields
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(rebuilt, am.GroupedAttentionMetadata)
  assert rebuilt["layer.0"] is rebuilt["layer.2"] is rebuilt["layer.3"]


def test_grouped_metadata_survives_a_jit_round_trip_with_shared_objects():
  """Inside and after jit, layers share objects."""
  grouped, groups = _grouped()
  seen = {}

  @jax.jit
  def step(md):
    seen["same"] = md["layer.0"] is md["layer.2"] is md["layer.3"]
    seen["distinct"] = md["layer.0"] is not md["layer.1"]
    seen["static"] = (md["layer.0"].padded_num_reqs, md["layer.1"].padded_num_reqs)
    return md, md["layer.1"].block_tables.sum()

  out, total = step(grouped)
  assert seen == {"same": True, "distinct": True, "static": (4, 4)}
  assert isinstance(out, am.GroupedAttentionMetadata)
  assert out["layer.0"] is out["layer.2"] is out["layer.3"]
  assert int(total) == int(np.sum(np.asarray(groups[1].block_tables)))
  np.testing.assert_array_equal(out["layer.1"].block_tables, groups[1].block_tables)


def test_grouped_metadata_tree_map_with_placeholder_leaves():
  """Unflattening with non-metadata children works."""
  grouped, _ = _grouped()
  counts = jax.tree.map(lambda x: 1, grouped, is_leaf=lambda x: isinstance(x, am.AttentionMetadata))
  assert dict(counts) == {"layer.0": 1, "layer.2": 1, "layer.3": 1, "layer.1": 1}


def test_grouped_metadata_copies():
  """copy and deepcopy rebuild the grouping."""
  grouped, _ = _grouped()
  for clone in (copy.copy(grouped), copy.deepcopy(grouped)):
    assert isinstance(clone, am.GroupedAttentionMetadata)
    assert clone.layer_names_per_group == grouped.layer_names_per_group
    assert clone["layer.0"] is clone["layer.2"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda g: g.__setitem__("layer.9", g["layer.0"]),
        lambda g: g.__delitem__("layer.0"),
        lambda g: g.clear(),
        lambda g: g.pop("layer.0"),
        lambda g: g.popitem(),
        lambda g: g.setdefault("layer.9", None),
        lambda g: g.update({}),
        lambda g: g.__ior__({}),
    ],
)
def test_grouped_metadata_is_immutable(mutate):
  """Every dict mutator raises, so the pytree stays one entry per group."""
  grouped, _ = _grouped()
  with pytest.raises(TypeError, match="GroupedAttentionMetadata is immutable"):
    mutate(grouped)
  assert len(grouped) == 4


@pytest.mark.parametrize(
    "groups, names, error, match",
    [
        ([_metadata()], [["layer.0"], ["layer.1"]], ValueError, "got 1 metadata groups but 2 lists of layer names"),
        ([_metadata(), "md"], [["layer.0"], ["layer.1"]], TypeError, "group 1 must be an AttentionMetadata; got str"),
        ([_metadata()], [[]], ValueError, "group 0 has no layer names"),
        ([_metadata()], [[3]], TypeError, "layer names must be str; group 0 has 3"),
        ([_metadata(), _metadata()], [["layer.0"], ["layer.0"]], ValueError, "'layer.0' is in group 0 and group 1"),
    ],
)
def test_grouped_metadata_rejects_bad_groups(groups, names, error, match):
  """Construction errors say what must hold."""
  with pytest.raises(error, match=match):
    am.GroupedAttentionMetadata(groups, names)


def test_metadata_for_layers():
  """Grouped lookup, single passthrough, and errors naming the known layers."""
  grouped, groups = _grouped()
  assert am.metadata_for_layers(grouped, ["layer.3", "layer.1", "layer.0"]) == [groups[0], groups[1], groups[0]]
  single = _metadata()
  assert all(md is single for md in am.metadata_for_layers(single, ["layer.7", "layer.0"]))
  assert am.metadata_for_layers({"layer.0": single}, ["layer.0"])[0] is single
  with pytest.raises(
      ValueError, match=r"no attention metadata for layer 'layer.5'; .* \['layer.0', 'layer.2', 'layer.3', 'layer.1'\]"
  ):
    am.metadata_for_layers(grouped, ["layer.0", "layer.5"])
  with pytest.raises(TypeError, match="must be an AttentionMetadata or a .* mapping; got list"):
    am.metadata_for_layers([single], ["layer.0"])
  # A KV-sharing layer outside every group (tpu-inference gives it no cache) takes its source's metadata.
  assert am.metadata_for_layers(grouped, ["layer.5", "layer.1"], {"layer.5": "layer.1"}) == [groups[1], groups[1]]
  with pytest.raises(ValueError, match="no attention metadata for layer 'layer.6'"):
    am.metadata_for_layers(grouped, ["layer.6"], {"layer.5": "layer.1"})
  with pytest.raises(TypeError, match="must be an AttentionMetadata or a .* mapping; got int"):
    am.metadata_for_layers(3, ["layer.0"])


@dataclasses.dataclass
class _RunnerMetadata:
  """A runner's own metadata class: tpu-inference 0.32.0's `layers/common/attention_metadata.py::AttentionMetadata`
  has these fields (the upstream tier passes the real class; this one lets the main suite run without it)."""

  input_positions: Any
  block_tables: Any
  seq_lens: Any
  query_start_loc: Any
  request_distribution: Any
  mamba_state_indices: Any = None
  pcp: Any = None
  padded_num_reqs: int = -1
  pcp_cache_pages: Any = None
  use_causal_mask: bool = True


def _runner_metadata(**changes):
  md = _metadata()
  fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(am.AttentionMetadata)}
  return _RunnerMetadata(**{**fields, **changes})


def test_runner_metadata_objects_are_read_by_field_keeping_group_sharing():
  """A foreign metadata class is converted once per object: layers of one group get one converted object."""
  first, second = _runner_metadata(), _runner_metadata(padded_num_reqs=2)
  out = am.metadata_for_layers({"layer.0": first, "layer.1": second, "layer.2": first}, ["layer.0", "layer.1", "layer.2"])
  assert isinstance(out[0], am.AttentionMetadata) and out[0] is out[2] and out[1] is not out[0]
  assert out[1].padded_num_reqs == 2 and out[0].block_tables is first.block_tables
  single = am.metadata_for_layers(first, ["layer.0", "layer.1"])
  assert single[0] is single[1] and single[0].seq_lens is first.seq_lens


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"pcp": object()}, NotImplementedError, r"attention_metadata\['layer.0'\]: attention_metadata.pcp is set"),
        ({"use_causal_mask": False}, NotImplementedError, "use_causal_mask is False; .* causally only"),
    ],
)
def test_runner_metadata_this_model_cannot_honour_is_refused(changes, error, match):
  with pytest.raises(error, match=match):
    am.metadata_for_layers({"layer.0": _runner_metadata(**changes)}, ["layer.0"])


def test_runner_metadata_without_the_fields_is_refused():
  @dataclasses.dataclass
  class Partial:
    """Two of the fields only."""

    seq_lens: Any
    block_tables: Any

  with pytest.raises(TypeError, match="got Partial without input_positions, query_start_loc"):
    am.metadata_for_layers(Partial(seq_lens=1, block_tables=2), ["layer.0"])
