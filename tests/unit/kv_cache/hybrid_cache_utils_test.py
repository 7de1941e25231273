"""Tests for maxtext.kv_cache.hybrid_cache_utils: resolve, gather and scatter of the runner's KV-cache map."""

import random
import re

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from support import hlo
from maxtext.kv_cache import hybrid_cache_utils as hcu

# Qwen3.5-style hybrid pattern: three Gated DeltaNet layers, then one full-attention layer, twice.
QWEN35_KINDS = ("linear", "linear", "linear", "full") * 2
# tpu-inference puts the 6 GDN states first, then the 2 attention caches (written out by hand).
QWEN35_RUNNER_SLOTS = (0, 1, 2, 6, 3, 4, 5, 7)


def _pairs(slots):
  """The runner's static map for `slots[i]` = slot of layer i."""
  return tuple((f"layer.{layer}", slot) for layer, slot in enumerate(slots))


# ---------------------------------------------------------------------------------------------------------------
# resolve_layer_kv_cache_indices: accepted maps


@pytest.mark.parametrize(
    "slots",
    [
        pytest.param((0, 1, 2, 3, 4, 5, 6, 7), id="identity"),
        pytest.param((7, 6, 5, 4, 3, 2, 1, 0), id="reversed"),
        pytest.param(QWEN35_RUNNER_SLOTS, id="qwen35_hybrid"),
        pytest.param((3, 0, 6, 1, 7, 2, 5, 4), id="shuffled"),
    ],
)
def test_resolve_returns_each_layers_slot(slots):
  assert hcu.resolve_layer_kv_cache_indices(_pairs(slots), 8, 8) == slots


@pytest.mark.parametrize("seed", range(5))
def test_resolve_random_permutations_in_any_entry_order(seed):
  rng = random.Random(seed)
  num_layers = rng.randint(1, 64)
  slots = list(range(num_layers))
  rng.shuffle(slots)
  pairs = list(_pairs(slots))
  rng.shuffle(pairs)
  assert hcu.resolve_layer_kv_cache_indices(tuple(pairs), num_layers, num_layers) == tuple(slots)


def test_resolve_kv_sharing_with_fewer_caches_than_layers():
  # Layers 4 and 5 reuse layer 3's KV cache; only 4 physical caches exist for 6 layers.
  slots = (0, 1, 2, 3, 3, 3)
  assert hcu.resolve_layer_kv_cache_indices(_pairs(slots), 6, 4) == slots


def test_resolve_allows_unused_slots():
  assert hcu.resolve_layer_kv_cache_indices({"layer.0": 4, "layer.1": 2}, 2, 6) == (4, 2)


@pytest.mark.parametrize(
    "as_input",
    [
        pytest.param(lambda pairs: pairs, id="tuple_of_pairs"),
        pytest.param(lambda pairs: [list(pair) for pair in pairs], id="list_of_lists"),
        pytest.param(dict, id="dict"),
        pytest.param(lambda pairs: dict(reversed(pairs)), id="dict_reversed_order"),
    ],
)
def test_resolve_mapping_and_pair_sequence_agree(as_input):
  assert hcu.resolve_layer_kv_cache_indices(as_input(_pairs(QWEN35_RUNNER_SLOTS)), 8, 8) == QWEN35_RUNNER_SLOTS


@pytest.mark.parametrize("np_type", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_resolve_accepts_numpy_integers_and_returns_python_ints(np_type):
  pairs = tuple((name, np_type(slot)) for name, slot in _pairs(QWEN35_RUNNER_SLOTS))
  resolved = hcu.resolve_layer_kv_cache_indices(pairs, np.int64(8), np.int32(8))
  assert resolved == QWEN35_RUNNER_SLOTS
  assert [type(slot) for slot in resolved] == [int] * 8


def test_resolve_ignores_draft_layers():
  # Drafter slots are the drafter's business: neither their layer numbers nor their slots are checked.
  pairs = (("layer.0", 1), ("draft_layer.0", 2), ("layer.1", 0), ("draft_layer.7", 99))
  assert hcu.resolve_layer_kv_cache_indices(pairs, 2, 3) == (1, 0)


@pytest.mark.parametrize("empty", [{}, (), [], (("draft_layer.0", 0),)])
def test_resolve_model_without_layers(empty):
  resolved = hcu.resolve_layer_kv_cache_indices(empty, 0, 0)
  assert isinstance(resolved, tuple)
  assert len(resolved) == 0


def test_layer_name():
  assert hcu.layer_name(0) == "layer.0"
  assert hcu.layer_name(47) == "layer.47"


# ---------------------------------------------------------------------------------------------------------------
# resolve_layer_kv_cache_indices: rejections


@pytest.mark.parametrize(
    "bad_name",
    [
        "layer.01",
        "layer.00",
        "layer.+1",
        "layer.-1",
        "layer. 1",
        " layer.1",
        "layer.1 ",
        "layer.1\n",
        "Layer.1",
        "LAYER.1",
        "layer.1.0",
        "layer.",
        "layer",
        "layer_1",
        "layer.1e0",
        "layer.0x1",
        "layer.\u0661",  # ARABIC-INDIC DIGIT ONE: int() would accept it.
        "draft_layer.01",
        "draft_layer.x",
        "",
    ],
)
def test_resolve_rejects_non_canonical_names(bad_name):
  pairs = (("layer.0", 0), (bad_name, 0))
  match = (
      rf"layer_name_to_kvcache_index entry 1 \({re.escape(repr(bad_name))}, 0\): layer name must be 'layer.<i>' or "
      rf"'draft_layer.<i>' with <i> a decimal integer without sign, spaces or leading zeros, got "
      rf"{re.escape(repr(bad_name))}"
  )
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices(pairs, 2, 2)


def test_resolve_rejects_non_canonical_name_in_mapping():
  with pytest.raises(ValueError, match=r"layer_name_to_kvcache_index\['layer.01'\]: layer name must be .*got 'layer.01'"):
    hcu.resolve_layer_kv_cache_indices({"layer.0": 0, "layer.01": 1}, 2, 2)


@pytest.mark.parametrize(
    "name, described",
    [(3, "int 3"), (None, "NoneType None"), (b"layer.0", "bytes b'layer.0'"), (("layer", 0), "tuple \\('layer', 0\\)")],
)
def test_resolve_rejects_non_string_names(name, described):
  with pytest.raises(
      TypeError,
      match=rf"layer_name_to_kvcache_index entry 0 .*: layer name must be a str such as 'layer.0', got {described}",
  ):
    hcu.resolve_layer_kv_cache_indices(((name, 0),), 1, 1)


def test_resolve_rejects_non_string_key_in_mapping():
  with pytest.raises(TypeError, match=r"layer_name_to_kvcache_index\[0\]: layer name must be a str .*got int 0"):
    hcu.resolve_layer_kv_cache_indices({0: 0}, 1, 1)


def test_resolve_rejects_non_string_draft_name_too():
  with pytest.raises(TypeError, match=r"entry 1 .*layer name must be a str"):
    hcu.resolve_layer_kv_cache_indices((("layer.0", 0), (7, 0)), 1, 1)


@pytest.mark.parametrize("name, num_layers", [("layer.8", 8), ("layer.100", 8), ("layer.0", 0)])
def test_resolve_rejects_layer_numbers_outside_the_model(name, num_layers):
  match = (
      rf"layer_name_to_kvcache_index\['{name}'\]: {name} is not a layer of this model; layer numbers must be in "
      rf"\[0, {num_layers}\) \(num_layers={num_layers}\)"
  )
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices({name: 0}, num_layers, 1)


@pytest.mark.parametrize(
    "pairs, where, name",
    [
        ((("layer.0", 0), ("layer.1", 1), ("layer.0", 0)), r"entry 2 \('layer.0', 0\)", "layer.0"),
        ((("layer.0", 0), ("layer.1", 1), ("layer.1", 0)), r"entry 2 \('layer.1', 0\)", "layer.1"),
        (
            (("draft_layer.0", 0), ("layer.0", 0), ("draft_layer.0", 1)),
            r"entry 2 \('draft_layer.0', 1\)",
            "draft_layer.0",
        ),
    ],
)
def test_resolve_rejects_duplicate_names(pairs, where, name):
  match = rf"layer_name_to_kvcache_index {where}: {name} appears more than once; each layer must have exactly one slot"
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices(pairs, 2, 2)


@pytest.mark.parametrize(
    "present, num_layers, listed",
    [
        ((0, 1, 2, 8), 10, "6 of 10 layers are missing: layer.3-7, layer.9"),
        ((1,), 2, "1 of 2 layers are missing: layer.0"),
        ((0, 2), 4, "2 of 4 layers are missing: layer.1, layer.3"),
        ((0, 3), 4, "2 of 4 layers are missing: layer.1-2"),
        ((), 3, "3 of 3 layers are missing: layer.0-2"),
        (
            tuple(range(0, 48, 2)) + tuple(range(40, 48)),
            48,
            "20 of 48 layers are missing: " + ", ".join(f"layer.{i}" for i in range(1, 39, 2)) + ", layer.39",
        ),
        ((4, 5, 6, 7, 20), 24, "19 of 24 layers are missing: layer.0-3, layer.8-19, layer.21-23"),
    ],
)
def test_resolve_lists_every_missing_layer(present, num_layers, listed):
  # A drafter entry keeps the map non-empty even when no decoder layer is present.
  pairs = tuple((f"layer.{layer}", 0) for layer in sorted(set(present))) + (("draft_layer.0", 0),)
  match = (
      rf"layer_name_to_kvcache_index must map every layer.<i>, i in \[0, {num_layers}\), to a kv_caches slot; "
      rf"{re.escape(listed)}$"
  )
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices(pairs, num_layers, 1)


@pytest.mark.parametrize(
    "index, described",
    [
        (3.0, "float 3.0"),
        (True, "bool True"),
        (False, "bool False"),
        ("1", "str '1'"),
        (None, "NoneType None"),
        (np.float32(1.0), "float32 np.float32\\(1.0\\)"),
        (np.bool_(True), "bool np.True_"),
        (np.array(1), "ndarray array\\(1\\)"),
        (jnp.int32(1), "ArrayImpl Array\\(1, dtype=int32.*\\)"),
    ],
)
def test_resolve_rejects_non_integer_slots(index, described):
  match = rf"layer_name_to_kvcache_index entry 0 .*: kv_caches index of layer.0 must be an int, got {described}"
  with pytest.raises(TypeError, match=match):
    hcu.resolve_layer_kv_cache_indices((("layer.0", index),), 1, 2)


def test_resolve_rejects_non_integer_draft_slots_too():
  with pytest.raises(TypeError, match=r"kv_caches index of draft_layer.0 must be an int, got float 0.0"):
    hcu.resolve_layer_kv_cache_indices({"layer.0": 0, "draft_layer.0": 0.0}, 1, 1)


@pytest.mark.parametrize("index", [8, 9, 100, -1, np.int64(-3)])
def test_resolve_rejects_slots_outside_kv_caches(index):
  match = (
      rf"layer_name_to_kvcache_index\['layer.5'\]: kv_caches index of layer.5 must be in \[0, 8\) "
      rf"\(num_kv_caches=8\), got {index}"
  )
  slots = {f"layer.{layer}": layer for layer in range(8)}
  slots["layer.5"] = index
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices(slots, 8, 8)


@pytest.mark.parametrize("empty", [{}, (), []])
def test_resolve_rejects_empty_map_for_a_model_with_layers(empty):
  match = (
      r"layer_name_to_kvcache_index is empty but the model has 4 layers; it must map every layer.<i>, "
      r"i in \[0, 4\), to a kv_caches slot"
  )
  with pytest.raises(ValueError, match=match):
    hcu.resolve_layer_kv_cache_indices(empty, 4, 4)


@pytest.mark.parametrize(
    "pair, described",
    [
        (("layer.0",), r"tuple \('layer.0',\)"),
        (("layer.0", 0, 1), r"tuple \('layer.0', 0, 1\)"),
        ([], r"list \[\]"),
        ("l0", "str 'l0'"),
        (b"l0", "bytes b'l0'"),
        ("layer.0", "str 'layer.0'"),
        (0, "int 0"),
        (None, "NoneType None"),
        ({"layer.0": 0}, r"dict \{'layer.0': 0\}"),
    ],
)
def test_resolve_rejects_malformed_pairs(pair, described):
  match = rf"layer_name_to_kvcache_index entry 1 must be a \(name, index\) pair, got {described}"
  with pytest.raises(TypeError, match=match):
    hcu.resolve_layer_kv_cache_indices((("layer.0", 0), pair), 1, 1)


@pytest.mark.parametrize(
    "bad_map, described",
    [
        (None, "NoneType None"),
        (8, "int 8"),
        ("layer.0", "str 'layer.0'"),
        (b"layer.0", "bytes b'layer.0'"),
        ({("layer.0", 0)}, r"set \{\('layer.0', 0\)\}"),
        ((pair for pair in [("layer.0", 0)]), "generator <generator object"),
    ],
)
def test_resolve_rejects_maps_that_are_neither_mappings_nor_pair_sequences(bad_map, described):
  match = (
      r"layer_name_to_kvcache_index must be a mapping \{name: index\} or a sequence of \(name, index\) pairs, "
      rf"got {described}"
  )
  with pytest.raises(TypeError, match=match):
    hcu.resolve_layer_kv_cache_indices(bad_map, 1, 1)


@pytest.mark.parametrize("arg_name", ["num_layers", "num_kv_caches"])
@pytest.mark.parametrize(
    "value, error, described",
    [
        (-1, ValueError, "-1"),
        (2.0, TypeError, "float 2.0"),
        (True, TypeError, "bool True"),
        (None, TypeError, "NoneType None"),
        ("2", TypeError, "str '2'"),
    ],
)
def test_resolve_validates_counts(arg_name, value, error, described):
  counts = {"num_layers": 1, "num_kv_caches": 1, arg_name: value}
  with pytest.raises(error, match=rf"{arg_name} must be a non-negative int, got {described}"):
    hcu.resolve_layer_kv_cache_indices({"layer.0": 0}, **counts)


# ---------------------------------------------------------------------------------------------------------------
# gather_layer_kv_caches / scatter_layer_kv_caches on fakes (identity is all that matters, so plain objects do)


def _fake_caches(num_slots):
  """Recurrent-state tuples in even slots and opaque 'arrays' in odd slots, all distinct objects."""
  return [(object(), object()) if slot % 2 == 0 else object() for slot in range(num_slots)]


def test_gather_returns_the_very_objects_in_layer_order():
  kv_caches = _fake_caches(8)
  gathered = hcu.gather_layer_kv_caches(kv_caches, QWEN35_RUNNER_SLOTS)
  assert len(gathered) == 8
  for layer, slot in enumerate(QWEN35_RUNNER_SLOTS):
    assert gathered[layer] is kv_caches[slot]


def test_gather_shared_slot_gives_layers_the_same_object():
  kv_caches = _fake_caches(4)
  gathered = hcu.gather_layer_kv_caches(kv_caches, (0, 1, 2, 3, 3, 3))
  assert gathered[3] is gathered[4] is gathered[5] is kv_caches[3]


@pytest.mark.parametrize("slot", [3, 5, -1])
def test_gather_rejects_slots_outside_kv_caches(slot):
  match = rf"layer.2 uses kv_caches\[{slot}\], but kv_caches has 3 entries; slots must be in \[0, 3\)"
  with pytest.raises(ValueError, match=match):
    hcu.gather_layer_kv_caches(_fake_caches(3), (0, 1, slot))


@pytest.mark.parametrize("slot, described", [(1.0, "float 1.0"), (None, "NoneType None"), (False, "bool False")])
def test_gather_rejects_non_integer_slots(slot, described):
  with pytest.raises(TypeError, match=rf"layer_indices\[1\] \(layer.1\) must be an int slot, got {described}"):
    hcu.gather_layer_kv_caches(_fake_caches(3), (0, slot))


def test_scatter_unchanged_returns_new_list_of_the_same_objects():
  kv_caches = _fake_caches(8)
  result = hcu.scatter_layer_kv_caches(
      kv_caches, hcu.gather_layer_kv_caches(kv_caches, QWEN35_RUNNER_SLOTS), QWEN35_RUNNER_SLOTS
  )
  assert result is not kv_caches
  assert len(result) == 8
  assert all(new is old for new, old in zip(result, kv_caches))


def test_scatter_writes_each_layer_into_its_slot():
  kv_caches = _fake_caches(8)
  updated = [object() for _ in range(8)]
  result = hcu.scatter_layer_kv_caches(kv_caches, updated, QWEN35_RUNNER_SLOTS)
  assert result == [updated[0], updated[1], updated[2], updated[4], updated[5], updated[6], updated[3], updated[7]]


def test_scatter_rebuilt_tuple_of_the_same_arrays_counts_as_unchanged():
  kv_caches = _fake_caches(2)
  conv, ssm = kv_caches[0]
  result = hcu.scatter_layer_kv_caches(kv_caches, [(conv, ssm), kv_caches[1]], (0, 1))
  assert result[0] is kv_caches[0]


def test_scatter_tuple_with_one_new_member_is_written():
  kv_caches = _fake_caches(2)
  conv, _ = kv_caches[0]
  new_state = (conv, object())
  result = hcu.scatter_layer_kv_caches(kv_caches, [new_state, kv_caches[1]], (0, 1))
  assert result[0] is new_state
  assert result[1] is kv_caches[1]


@pytest.mark.parametrize(
    "returned",
    [
        pytest.param(lambda conv, ssm: [conv, ssm], id="list_instead_of_tuple"),
        pytest.param(lambda conv, ssm: (conv,), id="shorter_tuple"),
        pytest.param(lambda conv, ssm: (conv, ssm, None), id="longer_tuple"),
    ],
)
def test_scatter_different_container_counts_as_a_write(returned):
  kv_caches = _fake_caches(1)
  new_state = returned(*kv_caches[0])
  assert hcu.scatter_layer_kv_caches(kv_caches, [new_state], (0,))[0] is new_state


def test_scatter_nested_tuples_compare_element_by_element():
  inner = (object(), object())
  kv_caches = [(inner, object())]
  unchanged = (tuple(inner), kv_caches[0][1])
  assert hcu.scatter_layer_kv_caches(kv_caches, [unchanged], (0,))[0] is kv_caches[0]
  changed = ((inner[0], object()), kv_caches[0][1])
  assert hcu.scatter_layer_kv_caches(kv_caches, [changed], (0,))[0] is changed


@pytest.mark.parametrize("writer", [3, 4, 5])
def test_scatter_shared_slot_with_one_writer(writer):
  kv_caches = _fake_caches(4)
  slots = (0, 1, 2, 3, 3, 3)
  updated = hcu.gather_layer_kv_caches(kv_caches, slots)
  new_cache = object()
  updated[writer] = new_cache
  result = hcu.scatter_layer_kv_caches(kv_caches, updated, slots)
  assert result[3] is new_cache
  assert all(result[slot] is kv_caches[slot] for slot in range(3))


def test_scatter_shared_slot_accepts_the_writers_object_forwarded_to_readers():
  kv_caches = _fake_caches(4)
  slots = (0, 1, 2, 3, 3, 3)
  new_cache = object()
  updated = kv_caches[:3] + [new_cache, new_cache, kv_caches[3]]
  assert hcu.scatter_layer_kv_caches(kv_caches, updated, slots)[3] is new_cache


def test_scatter_shared_recurrent_slot_accepts_rebuilt_forwarded_tuple():
  kv_caches = [(object(), object())]
  new_state = (object(), object())
  result = hcu.scatter_layer_kv_caches(kv_caches, [new_state, tuple(new_state)], (0, 0))
  assert result[0] is new_state


@pytest.mark.parametrize(
    "slots, writers, message",
    [
        ((0, 1, 2, 3, 3, 3), (3, 5), r"kv_caches\[3\] by layer.3, layer.5$"),
        ((0, 1, 2, 3, 3, 3), (3, 4, 5), r"kv_caches\[3\] by layer.3, layer.4, layer.5$"),
        ((0, 0, 1, 1), (0, 1, 2, 3), r"kv_caches\[0\] by layer.0, layer.1; kv_caches\[1\] by layer.2, layer.3$"),
    ],
)
def test_scatter_rejects_two_writers_to_one_slot(slots, writers, message):
  kv_caches = _fake_caches(max(slots) + 1)
  updated = hcu.gather_layer_kv_caches(kv_caches, slots)
  for layer in writers:
    updated[layer] = object()
  match = (
      r"at most one layer may write a shared kv_caches slot \(the others must return the object they were given or "
      rf"the writer's object\), but different new caches were returned for {message}"
  )
  with pytest.raises(ValueError, match=match):
    hcu.scatter_layer_kv_caches(kv_caches, updated, slots)


@pytest.mark.parametrize("num_updated", [2, 4])
def test_scatter_rejects_length_mismatch(num_updated):
  kv_caches = _fake_caches(3)
  match = rf"updated_layer_caches must have one cache per layer: got {num_updated} caches for 3 layer_indices"
  with pytest.raises(ValueError, match=match):
    hcu.scatter_layer_kv_caches(kv_caches, [object()] * num_updated, (0, 1, 2))


@pytest.mark.parametrize("slot", [3, -1])
def test_scatter_rejects_slots_outside_kv_caches(slot):
  match = rf"layer.1 uses kv_caches\[{slot}\], but kv_caches has 3 entries; slots must be in \[0, 3\)"
  with pytest.raises(ValueError, match=match):
    hcu.scatter_layer_kv_caches(_fake_caches(3), [object(), object()], (0, slot))


def test_scatter_rejects_non_integer_slots():
  with pytest.raises(TypeError, match=r"layer_indices\[0\] \(layer.0\) must be an int slot, got str '0'"):
    hcu.scatter_layer_kv_caches(_fake_caches(1), [object()], ("0",))


# ---------------------------------------------------------------------------------------------------------------
# Properties over random layer -> slot maps (with sharing and unused slots)


@st.composite
def _maps(draw):
  """A random layer -> slot map: (num_slots, slots per layer)."""
  num_slots = draw(st.integers(1, 10))
  num_layers = draw(st.integers(0, 16))
  slots = draw(st.lists(st.integers(0, num_slots - 1), min_size=num_layers, max_size=num_layers))
  return num_slots, tuple(slots)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(layout=_maps(), data=st.data())
def test_property_resolve_gather_scatter_round_trip(layout, data):
  num_slots, slots = layout
  pairs = data.draw(st.permutations(_pairs(slots)))
  assert hcu.resolve_layer_kv_cache_indices(tuple(pairs), len(slots), num_slots) == slots

  kv_caches = _fake_caches(num_slots)
  gathered = hcu.gather_layer_kv_caches(kv_caches, slots)
  # Rebuilt recurrent tuples around the same members are still "unchanged".
  returned = [tuple(cache) if isinstance(cache, tuple) and data.draw(st.booleans()) else cache for cache in gathered]
  result = hcu.scatter_layer_kv_caches(kv_caches, returned, slots)
  assert len(result) == num_slots
  assert all(new is old for new, old in zip(result, kv_caches))


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(layout=_maps(), data=st.data())
def test_property_one_writer_per_slot_lands_in_its_slot(layout, data):
  num_slots, slots = layout
  kv_caches = _fake_caches(num_slots)
  returned = hcu.gather_layer_kv_caches(kv_caches, slots)
  new_objects = {}  # slot -> (writer layer, new object)
  for slot in sorted(set(slots)):
    layers = [layer for layer, s in enumerate(slots) if s == slot]
    writer = data.draw(st.sampled_from([None, *layers]))
    if writer is None:
      continue
    new_objects[slot] = (writer, object())
    returned[writer] = new_objects[slot][1]
    for reader in layers:
      if reader != writer and data.draw(st.booleans()):
        returned[reader] = new_objects[slot][1]  # the decoder forwards the writer's cache to a sharing reader

  result = hcu.scatter_layer_kv_caches(kv_caches, returned, slots)
  assert len(result) == num_slots
  for slot in range(num_slots):
    expected = new_objects[slot][1] if slot in new_objects else kv_caches[slot]
    assert result[slot] is expected
  regathered = hcu.gather_layer_kv_caches(result, slots)
  for writer, new_object in new_objects.values():
    assert regathered[writer] is new_object


# ---------------------------------------------------------------------------------------------------------------
# Inside jax.jit: the remap adds no operation, and every layer's update lands in its slot


def _initial_caches(kinds, slots):
  """Caches in physical order for layer kinds placed at `slots`; every slot holds distinct values.

  Attention layers get an array `# [N=3, bs=2, 4]`; linear (recurrent) layers a `(conv # [M=2, 3, 5],
  ssm # [M=2, 2, 3])` tuple. Values are `1000 * (slot + 1) + position`, so a misrouted update is visible.
  """
  num_slots = max(slots) + 1
  caches = [None] * num_slots
  for layer, kind in enumerate(kinds):
    base = 1000.0 * (slots[layer] + 1)
    if kind == "full":
      caches[slots[layer]] = base + np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    else:
      caches[slots[layer]] = (
          base + np.arange(30, dtype=np.float32).reshape(2, 3, 5),
          base + 500.0 + np.arange(12, dtype=np.float32).reshape(2, 2, 3),
      )
  assert all(cache is not None for cache in caches)
  return caches


def _update_layer(layer, cache):
  """The per-layer 'model': writes row 1 of an attention cache, state slot 1 of both recurrent members."""
  if isinstance(cache, tuple):
    conv, ssm = cache
    return (conv.at[1].set(layer + 1.0), ssm.at[1].add(10.0 * (layer + 1)))
  return cache.at[1].add(layer + 1.0)


def _expected_after_step(kinds, slots, initial):
  """NumPy reference: layer i's update applied to `initial[slots[i]]`."""
  expected = [tuple(np.copy(m) for m in c) if isinstance(c, tuple) else np.copy(c) for c in initial]
  for layer, kind in enumerate(kinds):
    slot = slots[layer]
    if kind == "full":
      expected[slot][1] += layer + 1.0
    else:
      expected[slot][0][1] = layer + 1.0
      expected[slot][1][1] += 10.0 * (layer + 1)
  return expected


def _remap_step(kv_caches, layer_name_to_kvcache_index):
  layer_indices = hcu.resolve_layer_kv_cache_indices(
      layer_name_to_kvcache_index, len(layer_name_to_kvcache_index), len(kv_caches)
  )
  layer_caches = hcu.gather_layer_kv_caches(kv_caches, layer_indices)
  updated = [_update_layer(layer, cache) for layer, cache in enumerate(layer_caches)]
  return hcu.scatter_layer_kv_caches(kv_caches, updated, layer_indices)


def _direct_step(kv_caches, layer_name_to_kvcache_index):
  """What a model that ignores the map does; correct only for the identity layout."""
  del layer_name_to_kvcache_index
  return [_update_layer(layer, cache) for layer, cache in enumerate(kv_caches)]


def _program_size(step, kv_caches, pairs):
  """(jaxpr equations, compiled HLO instructions) of `step` with the map static (argument 1), caches donated."""
  to_device = [jax.tree.map(jnp.asarray, cache) for cache in kv_caches]
  eqns = hlo.count_jaxpr_equations(jax.make_jaxpr(step, static_argnums=1)(to_device, pairs))
  compiled = jax.jit(step, static_argnums=1, donate_argnums=0).lower(to_device, pairs).compile()
  return eqns, hlo.count_hlo_instructions(compiled.as_text())


_ATTENTION_ONLY = ("full",) * 8
_LAYOUTS = [
    pytest.param(_ATTENTION_ONLY, (7, 6, 5, 4, 3, 2, 1, 0), id="attention_reversed"),
    pytest.param(_ATTENTION_ONLY, (3, 0, 6, 1, 7, 2, 5, 4), id="attention_shuffled"),
    pytest.param(QWEN35_KINDS, QWEN35_RUNNER_SLOTS, id="qwen35_recurrent_first"),
    pytest.param(QWEN35_KINDS, (7, 2, 4, 0, 6, 1, 3, 5), id="qwen35_shuffled"),
]


@pytest.mark.parametrize("kinds, slots", _LAYOUTS)
def test_remap_adds_no_jaxpr_equation_or_hlo_instruction(kinds, slots):
  identity = tuple(range(len(kinds)))
  baseline = _program_size(_direct_step, _initial_caches(kinds, identity), _pairs(identity))
  identity_size = _program_size(_remap_step, _initial_caches(kinds, identity), _pairs(identity))
  remapped_size = _program_size(_remap_step, _initial_caches(kinds, slots), _pairs(slots))
  assert baseline[0] > 0 and baseline[1] > 0
  assert identity_size == baseline
  assert remapped_size == baseline


@pytest.mark.parametrize("kinds, slots", _LAYOUTS)
@pytest.mark.parametrize("pairs_form", [tuple, dict], ids=["pairs", "dict_in_closure"])
def test_jitted_step_lands_each_layers_update_in_its_slot(kinds, slots, pairs_form):
  initial = _initial_caches(kinds, slots)
  expected = _expected_after_step(kinds, slots, initial)
  layer_map = pairs_form(_pairs(slots))
  step = jax.jit(lambda kv_caches: _remap_step(kv_caches, layer_map), donate_argnums=0)
  result = step([jax.tree.map(jnp.asarray, cache) for cache in initial])
  assert len(result) == len(expected)
  for slot, (got, want) in enumerate(zip(result, expected)):
    assert isinstance(got, tuple) == isinstance(want, tuple), f"slot {slot}"
    for got_member, want_member in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got_member), want_member, err_msg=f"slot {slot}")


def test_jitted_step_with_kv_sharing_keeps_readers_slot_and_writes_once():
  # Layer 4 reads layer 3's cache (slot 3) without writing; layer 3 is the only writer.
  kinds = ("linear", "linear", "linear", "full", "full")
  slots = (1, 2, 0, 3, 3)
  kv_caches = [
      (jnp.full((2, 3, 5), 1.0), jnp.full((2, 2, 3), 2.0)),
      (jnp.full((2, 3, 5), 3.0), jnp.full((2, 2, 3), 4.0)),
      (jnp.full((2, 3, 5), 5.0), jnp.full((2, 2, 3), 6.0)),
      jnp.full((3, 2, 4), 7.0),
  ]

  def step(caches):
    layer_indices = hcu.resolve_layer_kv_cache_indices(_pairs(slots), len(kinds), len(caches))
    layer_caches = hcu.gather_layer_kv_caches(caches, layer_indices)
    updated = [_update_layer(layer, cache) if layer != 4 else cache for layer, cache in enumerate(layer_caches)]
    read_by_reader = updated[4][0, 0, 0]
    return hcu.scatter_layer_kv_caches(caches, updated, layer_indices), read_by_reader

  result, read_by_reader = jax.jit(step)(kv_caches)
  np.testing.assert_array_equal(np.asarray(result[3][1]), np.full((2, 4), 7.0 + 4.0))  # layer 3 wrote row 1
  np.testing.assert_array_equal(np.asarray(result[3][0]), np.full((2, 4), 7.0))
  np.testing.assert_array_equal(np.asarray(result[0][0][1]), np.full((3, 5), 3.0))  # layer 2 -> slot 0
  np.testing.assert_array_equal(np.asarray(result[1][0][1]), np.full((3, 5), 1.0))  # layer 0 -> slot 1
  np.testing.assert_array_equal(np.asarray(result[2][1][1]), np.full((2, 3), 6.0 + 20.0))  # layer 1 -> slot 2
  assert float(read_by_reader) == 7.0


def test_scatter_rejects_two_writers_while_tracing():
  def step(caches):
    layer_caches = hcu.gather_layer_kv_caches(caches, (0, 0))
    return hcu.scatter_layer_kv_caches(caches, [cache + 1.0 for cache in layer_caches], (0, 0))

  with pytest.raises(ValueError, match=r"different new caches were returned for kv_caches\[0\] by layer.0, layer.1"):
    jax.jit(step)([jnp.zeros(3)])


def test_resolve_logs_the_resolved_map_at_debug_level(caplog):
  with caplog.at_level("DEBUG", logger=hcu.__name__):
    hcu.resolve_layer_kv_cache_indices(_pairs(QWEN35_RUNNER_SLOTS), 8, 8)
  assert "layer_name_to_kvcache_index: 8 layers -> 8 kv_caches slots (0, 1, 2, 6, 3, 4, 5, 7)" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# Properties: valid maps with drafter entries resolve exactly; every single corruption is rejected with its own
# message (never an IndexError, never a wrong answer)


@st.composite
def _valid_maps(draw):
  """(entries in a random order, num_layers, num_slots, expected slots): sharing, unused slots, drafter entries.

  Drafter entries are named `draft_layer.<i>` (canonical decimal, any i) and carry any integer slot, NumPy ones
  included: the resolver type-checks them and ignores them.
  """
  num_slots, slots = draw(_maps())
  num_layers = len(slots)
  int_types = st.sampled_from([int, np.int32, np.int64, np.uint16])
  entries = [(f"layer.{layer}", draw(int_types)(slot)) for layer, slot in enumerate(slots)]
  drafts = draw(st.lists(st.integers(0, 40), unique=True, max_size=4))
  entries += [(f"draft_layer.{i}", draw(int_types)(draw(st.integers(0, 200)))) for i in drafts]
  return draw(st.permutations(entries)), num_layers, num_slots, slots


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(case=_valid_maps(), as_dict=st.booleans())
def test_property_valid_maps_with_drafter_entries_resolve_exactly(case, as_dict):
  entries, num_layers, num_slots, slots = case
  layer_map = dict(entries) if as_dict else tuple(entries)
  resolved = hcu.resolve_layer_kv_cache_indices(layer_map, num_layers, num_slots)
  assert resolved == slots
  assert all(type(slot) is int for slot in resolved)  # pylint: disable=unidiomatic-typecheck  # not np.int64


def _corrupt_name(layer, kind):
  return {
      "leading_zero": f"layer.0{layer}",
      "sign": f"layer.+{layer}",
      "space": f"layer. {layer}",
      "upper": f"Layer.{layer}",
      "suffix": f"layer.{layer}.0",
      "draft_leading_zero": f"draft_layer.0{layer}",
  }[kind]


_CORRUPTIONS = ["gap", "duplicate", "bad_name", "non_str_name", "bad_slot_type", "out_of_range", "extra_layer"]


@pytest.mark.slow
@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(case=_valid_maps(), kind=st.sampled_from(_CORRUPTIONS), data=st.data())
def test_property_each_corruption_is_rejected_with_its_message(case, kind, data):
  entries, num_layers, num_slots, _ = case
  hypothesis.assume(num_layers > 0)
  entries = list(entries)
  layer_positions = [i for i, (name, _) in enumerate(entries) if name.startswith("layer.")]
  position = data.draw(st.sampled_from(layer_positions))
  name, slot = entries[position]
  if kind == "gap":
    del entries[position]
    if not entries:
      error, match = ValueError, r"is empty but the model has \d+ layers"
    else:
      error, match = ValueError, rf"layers are missing: .*\b{re.escape(name)}\b"
  elif kind == "duplicate":
    entries.insert(data.draw(st.integers(position + 1, len(entries))), (name, data.draw(st.integers(0, num_slots - 1))))
    error, match = ValueError, rf"{re.escape(name)} appears more than once; each layer must have exactly one slot"
  elif kind == "bad_name":
    style = data.draw(st.sampled_from(["leading_zero", "sign", "space", "upper", "suffix", "draft_leading_zero"]))
    bad = _corrupt_name(int(name.split(".")[1]), style)
    entries[position] = (bad, slot)
    error, match = ValueError, rf"layer name must be 'layer.<i>' or 'draft_layer.<i>' .*, got {re.escape(repr(bad))}"
  elif kind == "non_str_name":
    bad = data.draw(st.sampled_from([int(name.split(".")[1]), None, name.encode(), (name,)]))
    entries[position] = (bad, slot)
    error, match = TypeError, r"layer name must be a str such as 'layer.0', got "
  elif kind == "bad_slot_type":
    bad = data.draw(
        st.sampled_from([True, False, float(slot), str(int(slot)), None, np.float32(slot), np.bool_(True), np.array(1)])
    )
    entries[position] = (name, bad)
    error, match = TypeError, rf"kv_caches index of {re.escape(name)} must be an int, got {re.escape(type(bad).__name__)}"
  elif kind == "out_of_range":
    bad = data.draw(st.one_of(st.integers(num_slots, num_slots + 100), st.integers(-100, -1)))
    entries[position] = (name, np.int64(bad) if data.draw(st.booleans()) else bad)
    error, match = ValueError, rf"kv_caches index of {re.escape(name)} must be in \[0, {num_slots}\) .*got {bad}$"
  else:  # extra_layer: a layer number the model does not have
    extra = f"layer.{data.draw(st.integers(num_layers, num_layers + 50))}"
    entries.insert(data.draw(st.integers(0, len(entries))), (extra, 0))
    error, match = ValueError, rf"{re.escape(extra)} is not a layer of this model; layer numbers must be in \[0, "
  with pytest.raises(error, match=match):
    hcu.resolve_layer_kv_cache_indices(tuple(entries), num_layers, num_slots)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(layout=_maps(), data=st.data())
def test_property_two_writers_on_one_slot_are_rejected_naming_both(layout, data):
  num_slots, slots = layout
  shared = [slot for slot in set(slots) if slots.count(slot) > 1]
  hypothesis.assume(shared)
  slot = data.draw(st.sampled_from(sorted(shared)))
  layers = [layer for layer, s in enumerate(slots) if s == slot]
  writers = sorted(data.draw(st.lists(st.sampled_from(layers), min_size=2, max_size=len(layers), unique=True)))
  kv_caches = _fake_caches(num_slots)
  returned = hcu.gather_layer_kv_caches(kv_caches, slots)
  for layer in writers:
    returned[layer] = object()
  names = ", ".join(f"layer.{layer}" for layer in writers)
  with pytest.raises(ValueError, match=rf"different new caches were returned for kv_caches\[{slot}\] by {names}$"):
    hcu.scatter_layer_kv_caches(kv_caches, returned, slots)


# check_shared_slot_writers


def test_writers_of_different_groups_and_kv_sharing_readers_may_share_a_slot():
  # A 5:1 model under vLLM's grouping (6 groups of 2): each array holds one layer of every group.
  hcu.check_shared_slot_writers((0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5) * 2, (False,) * 12)
  # A KV-sharing reader on its source's slot, in the source's group.
  hcu.check_shared_slot_writers((0, 1, 1), (0, 0, 0), (False, False, True))


def test_writers_of_one_group_sharing_a_slot_are_listed():
  with pytest.raises(
      ValueError,
      match=r"kv_caches\[1\] by layer.1, layer.3 \(KV-cache group 0\); "
      r"kv_caches\[2\] by layer.2, layer.4, layer.5 \(KV-cache group 1\)",
  ):
    hcu.check_shared_slot_writers((0, 1, 2, 1, 2, 2), (0, 0, 1, 0, 1, 1), (False, False, False, False, False, False))


def test_shared_slot_writers_need_one_entry_per_layer():
  with pytest.raises(ValueError, match=r"layer_indices \(2\), layer_groups \(1\) and kv_sharing \(2\)"):
    hcu.check_shared_slot_writers((0, 1), (0,), (False, False))
