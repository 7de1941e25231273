"""Tests of KV-cache grouping, physical layouts, cache allocation and per-request block / slot allocation."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.configs import config_to_dict
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.testing import kv_cache_checks

QWEN_RECURRENT = ("layer.0", "layer.1", "layer.2", "layer.4", "layer.5", "layer.6")


def _manager(cfg, make_specs, **kwargs):
  specs, shared = make_specs(cfg)
  return KVCacheManager(cfg, specs, shared, **kwargs)


def _with(cfg, **changes):
  """A plain-attribute copy of a loaded config with some values replaced (bypasses config validation)."""
  values = config_to_dict(cfg)
  values.update(changes)
  return types.SimpleNamespace(**values)


@pytest.mark.parametrize("hybrid_kv_cache", [True, False])
def test_qwen3_next_groups(configs, make_specs, hybrid_kv_cache):
  manager = _manager(configs["qwen3_next"](hybrid_kv_cache=hybrid_kv_cache), make_specs)
  assert len(manager.groups) == 2
  recurrent, attention = manager.groups[0], manager.groups[1]
  assert (recurrent.group_id, recurrent.kind, recurrent.layer_names) == (0, "recurrent", QWEN_RECURRENT)
  assert (attention.group_id, attention.kind, attention.layer_names) == (1, "attention", ("layer.3", "layer.7"))
  assert (attention.block_size, attention.sliding_window, recurrent.block_size) == (16, None, None)
  assert manager.attention_group_ids == (1,)
  assert manager.has_recurrent
  assert manager.group_of_layer("layer.5") == 0 and manager.group_of_layer("layer.7") == 1
  assert manager.max_blocks_per_req(0) == manager.max_blocks_per_req(1) == 1024 // 16


def test_qwen3_next_hybrid_layout_puts_recurrent_states_first(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="hybrid"), make_specs)
  assert manager.slot_owners == QWEN_RECURRENT + ("layer.3", "layer.7")
  assert manager.layer_name_to_kvcache_index == (
      ("layer.0", 0),
      ("layer.1", 1),
      ("layer.2", 2),
      ("layer.3", 6),
      ("layer.4", 3),
      ("layer.5", 4),
      ("layer.6", 5),
      ("layer.7", 7),
  )


def test_layer_layout_is_identity(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="layer"), make_specs)
  assert manager.layer_name_to_kvcache_index == tuple((f"layer.{i}", i) for i in range(8))


def test_shuffled_layout_is_the_seeded_permutation(configs, make_specs):
  cfg = configs["qwen3_next"](kv_cache_layout="shuffled", seed=3)
  specs, _ = make_specs(cfg)
  manager = _manager(cfg, make_specs)
  permutation = np.random.default_rng(3).permutation(8)
  assert manager.slot_owners == tuple(f"layer.{p}" for p in permutation)
  assert sorted(manager.slot_owners) == sorted(specs)
  for name, slot in manager.layer_name_to_kvcache_index:
    assert manager.slot_owners[slot] == name
  other = _manager(configs["qwen3_next"](kv_cache_layout="shuffled", seed=4), make_specs)
  assert other.slot_owners != manager.slot_owners


@pytest.mark.parametrize("layout", ["layer", "hybrid"])
def test_gemma3_kv_shared_layers_map_to_their_source_slot(configs, make_specs, layout):
  manager = _manager(configs["gemma3"](num_kv_shared_layers=2, kv_cache_layout=layout), make_specs)
  assert manager.slot_owners == ("layer.0", "layer.1", "layer.2", "layer.3")
  assert dict(manager.layer_name_to_kvcache_index) == {
      "layer.0": 0,
      "layer.1": 1,
      "layer.2": 2,
      "layer.3": 3,
      "layer.4": 3,
      "layer.5": 2,
  }
  assert len(manager.groups) == 2
  sliding, full = manager.groups[0], manager.groups[1]
  assert sliding.layer_names == ("layer.0", "layer.1", "layer.3", "layer.4")
  assert (sliding.sliding_window, sliding.kind) == (8, "attention")
  assert full.layer_names == ("layer.2", "layer.5") and full.sliding_window is None
  assert not manager.has_recurrent


def test_gemma3_without_hybrid_kv_cache_has_one_group_that_keeps_every_block(configs, make_specs):
  manager = _manager(configs["gemma3"](num_kv_shared_layers=2, hybrid_kv_cache=False), make_specs)
  assert len(manager.groups) == 1
  group = manager.groups[0]
  assert group.layer_names == tuple(f"layer.{i}" for i in range(6))
  assert group.sliding_window is None and group.kind == "attention"


def test_describe_slots_and_format_layout(configs, make_specs):
  manager = _manager(configs["qwen3_next"](kv_cache_layout="hybrid"), make_specs)
  slots = manager.describe_slots()
  assert len(slots) == 8
  first, attention = slots[0], slots[6]
  assert (first.slot, first.kind, first.layer_names, first.group_id) == (0, "recurrent", ("layer.0",), 0)
  assert first.shapes == ((9, 3, 128), (9, 4, 16, 16)) and first.dtypes == ("float32", "float32")
  assert first.nbytes == 9 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
  assert (attention.slot, attention.kind, attention.layer_names, attention.group_id) == (6, "attention", ("layer.3",), 1)
  assert attention.shapes == ((256, 16, 4, 1, 128),) and attention.dtypes == ("float32",)
  assert attention.nbytes == 256 * 16 * 4 * 128 * 4
  text = manager.format_layout()
  assert "kv_caches[6]: layer.3 attention group 1: (256, 16, 4, 1, 128) float32 = 8388608 bytes" in text
  assert f"total: {6 * 9 * 5632 + 2 * 8388608} bytes" in text

  shared = _manager(configs["gemma3"](num_kv_shared_layers=2), make_specs)
  assert shared.describe_slots(num_blocks=300)[3].layer_names == ("layer.3", "layer.4")
  assert "kv_caches[3]: layer.3 (shared by layer.4) attention group 0: (300, 16, 4, 1, 128)" in shared.format_layout(300)


@pytest.mark.parametrize(
    "dtype, attention_shape, attention_dtype",
    [("float32", (4, 16, 4, 1, 128), "float32"), ("bfloat16", (4, 16, 2, 2, 128), "bfloat16")],
)
def test_allocate_caches_in_runner_shapes(configs, make_specs, dtype, attention_shape, attention_dtype):
  cfg = configs["qwen3_next"](num_kv_blocks=4, dtype=dtype, weight_dtype=dtype, kv_cache_layout="hybrid")
  caches = _manager(cfg, make_specs, num_state_slots=5).allocate_caches()
  assert len(caches) == 8
  for conv, rec in caches[:6]:
    assert conv.shape == (5, 3, 128) and conv.dtype == jnp.dtype(dtype)
    assert rec.shape == (5, 4, 16, 16) and rec.dtype == jnp.float32
    assert not np.any(np.asarray(conv, np.float32)) and not np.any(np.asarray(rec))
  for cache in caches[6:]:
    assert cache.shape == attention_shape and cache.dtype == jnp.dtype(attention_dtype)
    assert not np.any(np.asarray(cache, np.float32))


def test_allocate_caches_rejects_fewer_blocks_than_the_pool(configs, make_specs):
  manager = _manager(configs["llama"](num_kv_blocks=8), make_specs)
  with pytest.raises(ValueError, match="num_blocks=4 is smaller than the block pools"):
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
  assert manager.num_free_blocks(0) == 3 and manager.has_request("a")
  manager.free("a")
  assert manager.num_free_blocks(0) == 6 and not kv_cache_checks.all_free(manager)
  manager.free("b")
  assert kv_cache_checks.all_free(manager) and not manager.has_request("a")
  assert not manager.drain_slots_to_zero()  # no recurrent layers


def test_sliding_group_frees_out_of_window_blocks_and_allocation_is_all_or_nothing(configs, make_specs):
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=6), make_specs)
  sliding, full = 0, 1
  assert manager.allocate_slots("a", 0, 16)
  assert manager.block_table("a", sliding) == [1, 2, 3, 4] == manager.block_table("a", full)
  # The query at position 16 reads keys 9..16: blocks 0 (keys 0-3) and 1 (4-7) are dead, block 2 (8-11) is not.
  assert manager.allocate_slots("a", 16, 1)
  assert manager.block_table("a", sliding) == [0, 0, 3, 4, 1]
  assert manager.block_table("a", full) == [1, 2, 3, 4, 5]
  assert (manager.num_free_blocks(sliding), manager.num_free_blocks(full)) == (2, 0)
  # The full group is exhausted: b gets nothing in any group.
  assert not manager.allocate_slots("b", 0, 4)
  assert (manager.num_free_blocks(sliding), manager.num_free_blocks(full)) == (2, 0)
  assert not manager.has_request("b")
  assert not manager.allocate_slots("a", 17, 4)  # 21 tokens need a 6th block in both groups
  assert manager.block_table("a", sliding) == [0, 0, 3, 4, 1]
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
  assert manager.num_free_blocks(0) == 31 - (len(table) - num_dead)


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
  assert manager.num_free_blocks(1) == 14 and not manager.has_request("b")


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
    manager.block_table("a", 1)
  with pytest.raises(ValueError, match="request 'a' holds no state slot"):
    manager.get_state_slot("a")
  with pytest.raises(ValueError, match=r"group 0 \(recurrent\) holds no blocks; recurrent layers use get_state_slot"):
    manager.block_table("a", 0)
  with pytest.raises(ValueError, match=r"group 0 \(recurrent\) holds no blocks"):
    manager.num_free_blocks(0)
  with pytest.raises(ValueError, match="group_id 2 is out of range: there are 2 KV-cache groups"):
    manager.num_free_blocks(2)
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


def test_check_consistency_finds_a_block_or_state_slot_held_twice(configs, make_specs):
  manager = _manager(configs["qwen3_next"](block_size=4, num_kv_blocks=16), make_specs)
  assert manager.allocate_slots("a", 0, 4) and manager.allocate_slots("b", 0, 4)
  # Corrupt the books on purpose: b's table names a's block, then b holds a's state slot.
  tables = manager._tables  # pylint: disable=protected-access  # the invariant check must see broken books
  tables["b"][1][0] = tables["a"][1][0]
  with pytest.raises(AssertionError, match=r"group 1 .*: block 1 has reference count 1 but 2 block-table entries"):
    kv_cache_checks.check_consistency(manager, {"a", "b"})
  tables["b"][1][0] = 2
  slots = manager._state_slots  # pylint: disable=protected-access  # as above
  slots["b"] = slots["a"]
  with pytest.raises(AssertionError, match=r"a state slot is held by two requests"):
    kv_cache_checks.check_consistency(manager, {"a", "b"})
