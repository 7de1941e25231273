"""Tests of what a KV cache holds per request and in total, hybrid allocator on and off (worked out by hand)."""

import pytest

from maxtext.inference.kv_cache_capacity import capacity, compare, request_blocks
from maxtext.inference.kv_cache_manager import KVCacheManager


def _manager(cfg, make_specs):
  specs, shared = make_specs(cfg)
  return KVCacheManager(cfg, specs, shared)


def test_a_sliding_group_keeps_the_blocks_its_window_reaches(configs, make_specs):
  # The fake gemma3: groups [0, 3], [1, 4] sliding (window 8), [2, 5] full; block 4. At 20 tokens the last query
  # (position 19) reads keys 12..19: blocks 3 and 4 of the 5.
  manager = _manager(configs["gemma3"](block_size=4, num_kv_blocks=64), make_specs)
  blocks = request_blocks(manager, 20)
  assert list(blocks.values()) == [2, 2, 5]
  cap = capacity(manager, 20)
  assert (cap.blocks_per_request, cap.concurrent_requests) == (9, 63 // 9)
  assert list(cap.tokens_per_group.values()) == [8, 8, 20]
  with pytest.raises(ValueError, match="context must be >= 1 token, got 0"):
    request_blocks(manager, 0)


def test_recurrent_state_slots_cap_the_requests(configs, make_specs):
  # qwen3_next: one attention group of 2 layers; 1024 usable blocks hold 256 requests of 4 blocks, but only
  # max(max_num_seqs, 8) = 8 state slots exist.
  manager = _manager(configs["qwen3_next"](block_size=16, num_kv_blocks=1025), make_specs)
  assert capacity(manager, 64).concurrent_requests == 8


def test_compare_gives_the_other_layout_the_same_bytes(configs, make_specs):
  cfg = configs["gemma3"](block_size=4, num_kv_blocks=61, max_target_length=20)
  on, off = compare(cfg, *make_specs(cfg))
  # On: 2 shared arrays, 61 blocks. Off: 6 arrays, so the same bytes hold 61 * 2 // 6 = 20 blocks, and a request
  # keeps all 5 of its blocks: 19 // 5 = 3 requests, against 60 // 9 = 6 on.
  assert (on.hybrid_kv_cache, off.hybrid_kv_cache) == (True, False)
  assert (on.num_blocks, off.num_blocks) == (61, 20) and on.cache_bytes == off.block_bytes * 61 // 3
  assert (on.concurrent_requests, off.concurrent_requests) == (6, 3)
  # Started from the off layout, off keeps its 61 blocks and on gets the same bytes.
  flat = configs["gemma3"](block_size=4, num_kv_blocks=61, max_target_length=20, hybrid_kv_cache=False)
  on, off = compare(flat, *make_specs(flat))
  assert (on.num_blocks, off.num_blocks) == (61 * 3, 61)
