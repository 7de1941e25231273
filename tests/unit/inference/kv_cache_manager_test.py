"""Tests of KV-cache grouping, physical layouts, cache allocation and per-request block / slot allocation."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.configs import config_to_dict
from maxtext.inference.kv_cache_manager import KVCacheManager

QWEN_RECURRENT = ("layer.0", "layer.1", "layer.2", "layer.4", "layer.5", "layer.6")


def _manager(cfg, make_specs, **kwargs):
  specs, shared = make_specs(cfg)
  return KVCacheManager(cfg, specs, shared, **kwargs)


def _with(cfg, **changes):
  """A plain-attribute copy of a loaded config with some values replaced (bypasses config validation)."""
  values = config_to_dict(cfg)
  values.update(changes)
  return types.SimpleNamespace(**values)


# Expected groups are worked out by hand from vLLM's rule (kv_cache_groups.py): the qwen3_next test config has 8
# layers, full attention at 3 and 7: buckets recurrent (6 layers) and attention (2); group size 2; the recurrent
# bucket splits into 3 groups, group i taking layers[i::3].
QWEN_GROUPS = (("layer.0", "layer.4"), ("layer.1", "layer.5"), ("layer.2", "layer.6"), ("layer.3", "layer.7"))


def test_qwen3_next_groups_follow_vllms_rule(configs, make_specs):
  manager = _manager(configs["qwen3_next"](), make_specs)
  assert tuple(g.layer_names for g in manager.groups) == QWEN_GROUPS
  assert tuple(g.kind for g in manager.groups) == ("recurrent",) * 3 + ("attention",)
  attention = manager.groups[3]
  assert (attention.block_size, attention.sliding_window, manager.groups[0].block_size) == (16, None, None)
  assert manager.attention_group_ids == (3,)
  assert manager.has_recurrent
  assert manager.group_of_layer("layer.5") == 1 and manager.group_of_layer("layer.7") == 3
  assert manager.max_blocks_per_req(0) == manager.max_blocks_per_req(3) == 1024 // 16


def test_qwen3_next_without_hybrid_kv_cache_keeps_one_group_per_kind(configs, make_specs):
  manager = _manager(configs["qwen3_next"](hybrid_kv_cache=False), make_specs)
  assert tuple(g.layer_names for g in manager.groups) == (QWEN_RECURRENT, ("layer.3", "layer.7"))
  assert manager.slot_owners == tuple((name,) for name in QWEN_RECURRENT + ("layer.3", "layer.7"))


def test_qwen3_next_hybrid_layout_is_one_array_per_layer_group_by_group(configs, make_specs):
  # tpu-inference keeps one array per layer when a model has recurrent layers, group after group.
  manager = _manager(configs["qwen3_next"](kv_cache_layout="hybrid"), make_specs)
  assert manager.slot_owners == tuple((name,) for group in QWEN_GROUPS for name in group)
  assert dict(manager.layer_name_to_kvcache_index) == {
      "layer.0": 0,
      "layer.4": 1,
      "layer.1": 2,
      "layer.5": 3,
      "layer.2": 4,
      "layer.6": 5,
      "layer.3": 6,
      "layer.7": 7,
  }
  assert manager.recurrent_slot_indices == (0, 1, 2, 3, 4, 5)


def test_layer_layout_is_identity(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="layer"), make_specs)
  assert manager.layer_name_to_kvcache_index == tuple((f"layer.{i}", i) for i in range(8))
  assert manager.recurrent_slot_indices == (0, 1, 2, 4, 5, 6)


def test_shuffled_layout_is_the_seeded_permutation_of_the_hybrid_order(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="shuffled", seed=3), make_specs)
  hybrid = [(name,) for group in QWEN_GROUPS for name in group]
  permutation = np.random.default_rng(3).permutation(8)
  assert manager.slot_owners == tuple(hybrid[p] for p in permutation)
  for name, slot in manager.layer_name_to_kvcache_index:
    assert manager.slot_owners[slot] == (name,)
  other = _manager(configs["qwen3_next"](kv_cache_layout="shuffled", seed=4), make_specs)
  assert other.slot_owners != manager.slot_owners


@pytest.mark.parametrize(
    "layout, arrays", [("hybrid", ((0, 1, 2), (3, 4, 5))), ("layer", ((0, 1, 2), (3, 4, 5))), ("shuffled", None)]
)
def test_gemma3_groups_share_arrays(configs, make_specs, layout, arrays):
  # 6 layers, sliding at 0 1 3 4, full at 2 5: buckets of 4 and 2, group size 2: sliding [0, 3], [1, 4], full
  # [2, 5]; the j-th layers of the three groups share array j.
  manager = _manager(configs["gemma3"](kv_cache_layout=layout, seed=1), make_specs)
  assert tuple(g.layer_names for g in manager.groups) == (
      ("layer.0", "layer.3"),
      ("layer.1", "layer.4"),
      ("layer.2", "layer.5"),
  )
  assert tuple(g.sliding_window for g in manager.groups) == (8, 8, None)
  if arrays is not None:
    assert manager.slot_owners == tuple(tuple(f"layer.{i}" for i in a) for a in arrays)
  index = dict(manager.layer_name_to_kvcache_index)
  assert index["layer.0"] == index["layer.1"] == index["layer.2"] != index["layer.3"]
  assert index["layer.3"] == index["layer.4"] == index["layer.5"]
  slots = manager.describe_slots()
  assert [s.group_ids for s in slots] == [(0, 1, 2), (0, 1, 2)]
  assert sum(s.nbytes for s in slots) == manager.num_blocks * manager.block_bytes


@pytest.mark.parametrize("layout", ["layer", "hybrid"])
def test_gemma3_kv_shared_layers_map_to_their_source_slot(configs, make_specs, layout):
  # Owners 0 1 2 3 (4 reads 3, 5 reads 2): buckets sliding [0, 1, 3] and full [2]: group size 1, so four groups
  # of one layer, each with an array of its own (tpu-inference's key for a one-layer group), in group order.
  manager = _manager(configs["gemma3"](num_kv_shared_layers=2, kv_cache_layout=layout), make_specs)
  expected = {
      "hybrid": ("layer.0", "layer.1", "layer.3", "layer.2"),
      "layer": ("layer.0", "layer.1", "layer.2", "layer.3"),
  }
  assert manager.slot_owners == tuple((name,) for name in expected[layout])
  index = dict(manager.layer_name_to_kvcache_index)
  assert index["layer.4"] == index["layer.3"] and index["layer.5"] == index["layer.2"]
  assert sorted(index[f"layer.{i}"] for i in range(4)) == [0, 1, 2, 3]
  assert tuple(g.layer_names for g in manager.groups) == (
      ("layer.0",),
      ("layer.1",),
      ("layer.3", "layer.4"),
      ("layer.2", "layer.5"),
  )
  assert tuple(g.sliding_window for g in manager.groups) == (8, 8, 8, None)
  assert not manager.has_recurrent


def test_gemma3_without_hybrid_kv_cache_has_one_group_that_keeps_every_block(configs, make_specs):
  manager = _manager(configs["gemma3"](num_kv_shared_layers=2, hybrid_kv_cache=False), make_specs)
  assert len(manager.groups) == 1
  group = manager.groups[0]
  assert group.layer_names == tuple(f"layer.{i}" for i in range(6))
  assert group.sliding_window is None and group.kind == "attention"
  assert manager.slot_owners == (("layer.0",), ("layer.1",), ("layer.2",), ("layer.3",))


@pytest.mark.parametrize("hybrid_kv_cache, arrays", [(True, 2), (False, 6)])
def test_kv_cache_memory_bytes_sizes_the_pool_by_the_layout(configs, make_specs, hybrid_kv_cache, arrays):
  # One block of one fake gemma3 array: (16 tokens, 4 packed heads, 1, 128) float32 = 32768 bytes.
  cfg = configs["gemma3"](hybrid_kv_cache=hybrid_kv_cache, kv_cache_memory_bytes=6 * 32768 * 10 + 5)
  manager = _manager(cfg, make_specs)
  assert manager.block_bytes == arrays * 32768
  assert manager.num_blocks == 6 * 10 // arrays
  explicit_cfg = configs["gemma3"](hybrid_kv_cache=hybrid_kv_cache, kv_cache_memory_bytes=10**9, num_kv_blocks=7)
  explicit = _manager(explicit_cfg, make_specs)
  assert explicit.num_blocks == 7
  # Neither set: 256 blocks per attention group (three hybrid groups; one without the hybrid allocator).
  default = _manager(configs["gemma3"](hybrid_kv_cache=hybrid_kv_cache), make_specs)
  assert default.num_blocks == 256 * len(default.attention_group_ids) == (768 if hybrid_kv_cache else 256)
  too_small = arrays * 32768 + 5
  with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={too_small} holds 1 blocks of {arrays * 32768} bytes"):
    _manager(configs["gemma3"](hybrid_kv_cache=hybrid_kv_cache, kv_cache_memory_bytes=too_small), make_specs)


def test_kv_cache_memory_bytes_leaves_room_for_the_state_slots(configs, make_specs):
  # 6 recurrent arrays of 9 slots of 5632 bytes; 2 attention arrays of 32768 bytes a block.
  states = 6 * 9 * 5632
  manager = _manager(configs["qwen3_next"](kv_cache_memory_bytes=states + 2 * 32768 * 20), make_specs)
  assert (manager.block_bytes, manager.num_blocks) == (2 * 32768, 20)


def test_describe_slots_and_format_layout(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="layer"), make_specs)
  slots = manager.describe_slots()
  assert len(slots) == 8
  first, attention = slots[0], slots[3]
  assert (first.slot, first.kind, first.layer_names, first.group_ids) == (0, "recurrent", ("layer.0",), (0,))
  assert first.shapes == ((9, 3, 128), (9, 4, 16, 16)) and first.dtypes == ("float32", "float32")
  assert first.nbytes == 9 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
  assert (attention.slot, attention.kind, attention.layer_names, attention.group_ids) == (
      3,
      "attention",
      ("layer.3",),
      (3,),
  )
  assert attention.shapes == ((256, 16, 4, 1, 128),) and attention.dtypes == ("float32",)
  assert attention.nbytes == 256 * 16 * 4 * 128 * 4
  text = manager.format_layout()
  assert "kv_caches[3]: layer.3 attention group 3: (256, 16, 4, 1, 128) float32 = 8388608 bytes" in text
  assert f"total: {6 * 9 * 5632 + 2 * 8388608} bytes" in text

  shared = _manager(configs["gemma3"](num_kv_shared_layers=2, kv_cache_layout="layer"), make_specs)
  assert shared.num_blocks == 4 * 256  # four attention groups
  assert shared.describe_slots(num_blocks=1100)[3].layer_names == ("layer.3", "layer.4")
  assert "kv_caches[3]: layer.3, layer.4 attention group 2: (1100, 16, 4, 1, 128)" in shared.format_layout(1100)
  gemma = _manager(configs["gemma3"](), make_specs).format_layout()
  assert "kv_caches[0]: layer.0, layer.1, layer.2 attention groups 0, 1, 2: (768, 16, 4, 1, 128)" in gemma


@pytest.mark.parametrize(
    "dtype, attention_shape, attention_dtype",
    [("float32", (4, 16, 4, 1, 128), "float32"), ("bfloat16", (4, 16, 2, 2, 128), "bfloat16")],
)
def test_allocate_caches_in_runner_shapes(configs, make_specs, dtype, attention_shape, attention_dtype):
  cfg = configs["qwen3_next"](num_kv_blocks=4, dtype=dtype, weight_dtype=dtype, kv_cache_layout="hybrid")
  caches = _manager(cfg, make_specs, num_state_slots=5).allocate_caches()
  assert len(caches) == 8
  for conv, rec in caches[:6]:  # the hybrid order: every recurrent group before the attention group
    assert conv.shape == (5, 3, 128) and conv.dtype == jnp.dtype(dtype)
    assert rec.shape == (5, 4, 16, 16) and rec.dtype == jnp.float32
    assert not np.any(np.asarray(conv, np.float32)) and not np.any(np.asarray(rec))
  for cache in caches[6:]:
    assert cache.shape == attention_shape and cache.dtype == jnp.dtype(attention_dtype)
    assert not np.any(np.asarray(cache, np.float32))


def test_allocate_caches_rejects_fewer_blocks_than_the_pool(configs, make_specs):
  manager = _manager(configs["llama"](num_kv_blocks=8), make_specs)
  with pytest.raises(ValueError, match="num_blocks=4 is smaller than the block pool"):
    manager.allocate_caches(4)
  assert manager.allocate_caches(10)[0].shape[0] == 10


def test_allocate_grow_and_free(configs, make_specs):
  manager = _manager(configs["llama"](block_size=4, num_kv_blocks=8), make_specs)
  assert manager.allocate_slots("a", 0, 5)
  assert manager.block_table("a", 0) == [1, 2]
  assert manager.allocate_slots("a", 5, 1)
  assert manager.block_table("a", 0) == [1, 2]
  assert manager.allocate_slots("a", 6, 3)
  assert manager.block_table("a", 0) == [1, 2, 3]
  assert manager.allocate_slots("b", 0, 4)
  assert manager.block_table("b", 0) == [4]
  assert manager.num_free_blocks() == 3 and manager.has_request("a")
  assert manager.num_used_blocks(0) == 4 and manager.peak_used_blocks == 4
  manager.free("a")
  assert manager.num_free_blocks() == 6 and not kv_cache_checks.all_free(manager)
  assert manager.peak_used_blocks == 4
  manager.free("b")
  assert kv_cache_checks.all_free(manager) and not manager.has_request("a")
  assert not manager.drain_slots_to_zero()  # no recurrent layers


def test_sliding_groups_free_blocks_into_the_shared_pool_and_allocation_is_all_or_nothing(configs, make_specs):
  # Groups: 0 sliding [0, 3], 1 sliding [1, 4], 2 full [2, 5] (window 8), all drawing from 13 usable blocks.
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=14), make_specs)
  assert manager.allocate_slots("a", 0, 16)
  assert [manager.block_table("a", g) for g in range(3)] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
  # The query at position 16 reads keys 9..16: blocks 0 (keys 0-3) and 1 (4-7) of each sliding group are dead; the
  # freed blocks serve any group (block 5, group 1's, now holds the full group's keys 16-19).
  assert manager.allocate_slots("a", 16, 1)
  assert [manager.block_table("a", g) for g in range(3)] == [[0, 0, 3, 4, 1], [0, 0, 7, 8, 2], [9, 10, 11, 12, 5]]
  assert manager.num_free_blocks() == 2
  assert [manager.num_used_blocks(g) for g in range(3)] == [3, 3, 5]
  kv_cache_checks.check_consistency(manager, ["a"])
  # b needs a block in each of the three groups: nothing is allocated.
  assert not manager.allocate_slots("b", 0, 4)
  assert manager.num_free_blocks() == 2 and not manager.has_request("b")
  assert not manager.allocate_slots("a", 17, 4)  # 21 tokens need a 6th block in every group
  assert manager.block_table("a", 0) == [0, 0, 3, 4, 1]
  assert manager.peak_used_blocks == 12
  manager.free("a")
  assert kv_cache_checks.all_free(manager)


@pytest.mark.parametrize("num_computed, num_dead", [(7, 0), (10, 0), (11, 1), (14, 1), (15, 2), (19, 3)])
def test_sliding_window_boundary(configs, make_specs, num_computed, num_dead):
  # W = 8, block_size 4: the query at position c reads keys c-7 .. c, so blocks entirely below c-7 are dead.
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=32), make_specs)
  manager.allocate_slots("a", 0, num_computed)
  manager.allocate_slots("a", num_computed, 1)
  table = manager.block_table("a", 0)
  assert table[:num_dead] == [0] * num_dead and 0 not in table[num_dead:]
  assert manager.num_used_blocks(0) == manager.num_used_blocks(1) == len(table) - num_dead
  assert manager.num_free_blocks() == 31 - 2 * (len(table) - num_dead) - len(manager.block_table("a", 2))


def test_no_freeing_without_hybrid_kv_cache(configs, make_specs):
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=32, hybrid_kv_cache=False), make_specs)
  manager.allocate_slots("a", 0, 19)
  manager.allocate_slots("a", 19, 1)
  assert manager.block_table("a", 0) == [1, 2, 3, 4, 5]


def test_state_slots_follow_requests(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16), make_specs)
  assert manager.allocate_slots("a", 0, 3) and manager.allocate_slots("b", 0, 3)
  assert (manager.get_state_slot("a"), manager.get_state_slot("b")) == (1, 2)
  assert manager.allocate_slots("a", 3, 1) and manager.get_state_slot("a") == 1
  manager.free("a")
  assert manager.drain_slots_to_zero() == [1]
  assert manager.allocate_slots("c", 0, 1) and manager.get_state_slot("c") == 1
  assert manager.num_free_state_slots() == 9 - 1 - 2
  manager.free("b")
  manager.free("c")
  assert kv_cache_checks.all_free(manager) and manager.drain_slots_to_zero() == [2, 1]


def test_no_free_state_slot_means_no_allocation(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16), make_specs, num_state_slots=2)
  assert manager.allocate_slots("a", 0, 3)
  assert not manager.allocate_slots("b", 0, 3)
  assert manager.num_free_blocks() == 14 and not manager.has_request("b")


def test_check_request_fits(configs, make_specs):
  manager = _manager(configs["llama"](block_size=4, num_kv_blocks=4), make_specs)
  manager.check_request_fits("a", 12)
  with pytest.raises(ValueError, match=r"request 'a': 13 tokens need 4 blocks in group 0 .* pool has 3"):
    manager.check_request_fits("a", 13)
  sliding_only = {"layer_types": ["sliding_attention"] * 2, "block_size": 4, "num_kv_blocks": 4}
  _manager(configs["gemma3"](base_num_decoder_layers=2, **sliding_only), make_specs).check_request_fits("a", 500)
  no_freeing = configs["gemma3"](base_num_decoder_layers=2, hybrid_kv_cache=False, **sliding_only)
  with pytest.raises(ValueError, match="500 tokens need 125 blocks"):
    _manager(no_freeing, make_specs).check_request_fits("a", 500)


def test_allocation_errors(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16, max_target_length=32), make_specs)
  with pytest.raises(ValueError, match="need num_computed_tokens >= 0 and num_new_tokens >= 1, got 0 and 0"):
    manager.allocate_slots("a", 0, 0)
  with pytest.raises(ValueError, match="33 tokens exceed max_target_length=32"):
    manager.allocate_slots("a", 0, 33)
  with pytest.raises(ValueError, match="num_computed_tokens=3 but blocks exist only for 0 tokens"):
    manager.allocate_slots("a", 3, 1)
  with pytest.raises(ValueError, match="request 'a' holds no blocks"):
    manager.free("a")
  with pytest.raises(ValueError, match="request 'a' holds no blocks"):
    manager.block_table("a", 3)
  with pytest.raises(ValueError, match="request 'a' holds no state slot"):
    manager.get_state_slot("a")
  with pytest.raises(ValueError, match=r"group 0 \(recurrent\) holds no blocks; recurrent layers use get_state_slot"):
    manager.block_table("a", 0)
  with pytest.raises(ValueError, match=r"group 0 \(recurrent\) holds no blocks"):
    manager.num_used_blocks(0)
  with pytest.raises(ValueError, match="group_id 4 is out of range: there are 4 KV-cache groups"):
    manager.num_used_blocks(4)
  with pytest.raises(ValueError, match="unknown layer 'layer.8'"):
    manager.group_of_layer("layer.8")
  llama = _manager(configs["llama"](), make_specs)
  with pytest.raises(ValueError, match="the model has no recurrent layers"):
    llama.get_state_slot("a")
  assert llama.num_free_state_slots() == 0


def test_construction_errors(configs, make_specs, spec_types):
  attention_spec, recurrent_spec = spec_types
  cfg = configs["qwen3_next"]()
  specs, shared = make_specs(cfg)

  def build(spec_changes=None, shared_layers=None, config=cfg):
    changed = dict(specs)
    for name, spec in (spec_changes or {}).items():
      if spec is None:
        del changed[name]
      else:
        changed[name] = spec
    return KVCacheManager(config, changed, shared if shared_layers is None else shared_layers)

  with pytest.raises(ValueError, match=r"missing \['layer.7'\], unexpected \[\]"):
    build({"layer.7": None})
  with pytest.raises(ValueError, match=r"missing \[\], unexpected \['layer.9'\]"):
    build({"layer.9": specs["layer.7"]})
  with pytest.raises(ValueError, match="a decoder layer name must be 'layer.<i>' .* got 'blk.0'"):
    build({"blk.0": specs["layer.7"]})
  with pytest.raises(ValueError, match="a decoder layer name must be 'layer.<i>' .* got 'layer.03'"):
    build({"layer.03": specs["layer.3"], "layer.3": None})
  with pytest.raises(ValueError, match="layer.7 has a spec and is also a KV-shared layer"):
    build(shared_layers={"layer.7": "layer.3"})
  with pytest.raises(ValueError, match="layer.3 has a recurrent spec but cfg.layer_types says full_attention"):
    build({"layer.3": specs["layer.0"]})
  sliding = attention_spec("sliding_attention", 16, 2, 16, "float32", 8)
  with pytest.raises(ValueError, match="layer.3 has an attention spec of type sliding_attention but cfg.layer_types"):
    build({"layer.3": sliding})
  with pytest.raises(ValueError, match="KV-shared layer.7 reads layer.0, which must be an attention layer"):
    build({"layer.7": None}, shared_layers={"layer.7": "layer.0"})
  with pytest.raises(TypeError, match="layer.0: a KV-cache spec must declare cache_kind .* got str"):
    build({"layer.0": "gdn"})
  assert isinstance(specs["layer.0"], recurrent_spec)
  with pytest.raises(ValueError, match="kv_cache_layout='diagonal': must be one of layer, hybrid, shuffled"):
    build(config=_with(cfg, kv_cache_layout="diagonal"))

  gemma = configs["gemma3"](hybrid_kv_cache=False)
  gemma_specs, _ = make_specs(gemma)
  gemma_specs["layer.2"] = attention_spec("full_attention", 32, 2, 16, "float32", None)
  with pytest.raises(ValueError, match="needs one block size: layer.0 has block_size 16 but layer.2 has 32"):
    KVCacheManager(gemma, gemma_specs, {})


def test_check_consistency_passes_on_real_bookkeeping_and_names_a_leak(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16), make_specs)
  assert manager.allocate_slots("a", 0, 9) and manager.allocate_slots("b", 0, 3)
  kv_cache_checks.check_consistency(manager, {"a", "b"})
  with pytest.raises(AssertionError, match=r"requests holding caches \['a', 'b'\] differ from the live requests \['a'\]"):
    kv_cache_checks.check_consistency(manager, {"a"})  # "b" finished without being freed: a leak
  manager.free("b")
  kv_cache_checks.check_consistency(manager, {"a"})


def test_check_consistency_finds_a_block_in_two_groups(configs, make_specs):
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=16), make_specs)
  assert manager.allocate_slots("a", 0, 4)
  tables = manager._tables  # pylint: disable=protected-access  # the invariant check must see broken books
  manager._pool.incref([tables["a"][0][0]])  # pylint: disable=protected-access  # counts agree, groups do not
  tables["a"][1][0] = tables["a"][0][0]
  with pytest.raises(AssertionError, match=r"block 1 is in the tables of groups 0 and 1"):
    kv_cache_checks.check_consistency(manager, {"a"})


def test_check_consistency_finds_a_block_or_state_slot_held_twice(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16), make_specs)
  assert manager.allocate_slots("a", 0, 4) and manager.allocate_slots("b", 0, 4)
  # Corrupt the books on purpose: b's table names a's block, then b holds a's state slot.
  tables = manager._tables  # pylint: disable=protected-access  # the invariant check must see broken books
  tables["b"][3][0] = tables["a"][3][0]
  with pytest.raises(AssertionError, match=r"block 1 has reference count 1 but 2 block-table entries"):
    kv_cache_checks.check_consistency(manager, {"a", "b"})
  tables["b"][3][0] = 2
  slots = manager._state_slots  # pylint: disable=protected-access  # as above
  slots["b"] = slots["a"]
  with pytest.raises(AssertionError, match=r"a state slot is held by two requests"):
    kv_cache_checks.check_consistency(manager, {"a", "b"})
