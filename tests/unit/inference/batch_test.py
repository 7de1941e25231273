"""Tests of the step-input / metadata builder against hand-computed arrays."""

import numpy as np
import pytest

from maxtext.inference import SamplingParams
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata
from maxtext.inference.batch import (
    METADATA_FIELDS,
    build_batch,
    max_num_reqs,
    next_power_of_two,
    padded_num_requests,
    padded_num_tokens,
)
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.request import Request
from maxtext.inference.scheduler import Scheduler


def _setup(cfg, make_specs):
  specs, shared = make_specs(cfg)
  manager = KVCacheManager(cfg, specs, shared)
  return Scheduler(cfg, manager), manager


def _table(rows, width):
  table = np.zeros((8, width), np.int32)
  for i, row in enumerate(rows):
    table[i, : len(row)] = row
  return table.reshape(-1)


def test_mixed_batch_decode_chunked_prefill_and_new_prefill(configs, make_specs):
  cfg = configs["qwen3_next"](
      block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, max_target_length=32
  )
  scheduler, manager = _setup(cfg, make_specs)
  scheduler.add_request(Request("a", [10, 11, 12, 13, 14]))
  scheduler.add_request(Request("b", list(range(20, 34))))
  out = scheduler.schedule()  # a: 5 tokens, b: 11 of 14
  scheduler.update_from_output(out, {"a": 7})
  scheduler.add_request(Request("c", [40, 41, 42]))
  out = scheduler.schedule()  # a decodes, b finishes its prompt (3), c prefills (3)
  batch = build_batch(cfg, out, manager)

  assert batch.request_ids == ("a", "b", "c") and batch.num_scheduled_tokens == (1, 3, 3)
  assert (batch.num_reqs, batch.num_tokens, batch.num_decodes) == (3, 7, 1)
  assert (batch.padded_num_tokens, batch.padded_num_reqs) == (8, 8)
  np.testing.assert_array_equal(batch.input_ids, [7, 31, 32, 33, 40, 41, 42, 0])
  np.testing.assert_array_equal(batch.positions, [5, 11, 12, 13, 0, 1, 2, 0])
  np.testing.assert_array_equal(batch.seq_lens, [6, 14, 3, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch.query_start_loc, [0, 1, 4, 7, 7, 7, 7, 7, 7])
  np.testing.assert_array_equal(batch.request_distribution, [1, 1, 3])
  np.testing.assert_array_equal(batch.mamba_state_indices, [1, 2, 3, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch.logits_indices, [0, 3, 6, 0, 0, 0, 0, 0])
  # Groups by vLLM's rule: recurrent (0, 4), (1, 5), (2, 6), then attention (3, 7).
  *recurrent_tables, attention_table = batch.block_tables
  assert len(recurrent_tables) == 3
  for recurrent_table in recurrent_tables:
    np.testing.assert_array_equal(recurrent_table, np.zeros(64, np.int32))
  np.testing.assert_array_equal(attention_table, _table([[1, 2], [3, 4, 5, 6], [7]], 8))
  for array in (batch.input_ids, batch.positions, batch.seq_lens, batch.query_start_loc, attention_table):
    assert array.dtype == np.int32
  assert batch.layer_names_per_group == (
      ("layer.0", "layer.4"),
      ("layer.1", "layer.5"),
      ("layer.2", "layer.6"),
      ("layer.3", "layer.7"),
  )

  groups = batch.metadata_fields()
  assert len(groups) == 4 and all(tuple(g) == METADATA_FIELDS for g in groups)
  assert groups[0]["block_tables"] is recurrent_tables[0] and groups[3]["block_tables"] is attention_table
  for name in ("input_positions", "seq_lens", "query_start_loc", "request_distribution", "mamba_state_indices"):
    assert groups[0][name] is groups[3][name]
  assert groups[0]["input_positions"] is batch.positions and groups[3]["padded_num_reqs"] == 8

  metadata = [AttentionMetadata(**fields) for fields in groups]  # the engine's one-line construction
  for md in metadata:
    md.validate()
  grouped = GroupedAttentionMetadata(metadata, batch.layer_names_per_group)
  assert grouped["layer.3"] is grouped["layer.7"] is metadata[3] and grouped["layer.4"] is metadata[0]


def test_sliding_group_table_has_null_entries_for_freed_blocks(configs, make_specs):
  cfg = configs["gemma3"](block_size=4, num_kv_blocks=32, max_num_batched_tokens=32, max_target_length=64)
  scheduler, manager = _setup(cfg, make_specs)
  scheduler.add_request(Request("a", list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=4)))
  scheduler.update_from_output(scheduler.schedule(), {"a": 9})
  batch = build_batch(cfg, scheduler.schedule(), manager)
  # Groups (0, 3), (1, 4) sliding and (2, 5) full share one pool: the prompt took blocks 1-5, 6-10, 11-15. The
  # decode at position 20 reads keys 13..20 (window 8): blocks 0-2 (keys 0-11) of both sliding groups went back to
  # the pool, and each group's new 6th block is the lowest free id, the full group's one a sliding group freed.
  sliding, other_sliding, full = batch.block_tables
  np.testing.assert_array_equal(sliding, _table([[0, 0, 0, 4, 5, 1]], 16))
  np.testing.assert_array_equal(other_sliding, _table([[0, 0, 0, 9, 10, 2]], 16))
  np.testing.assert_array_equal(full, _table([[11, 12, 13, 14, 15, 3]], 16))
  np.testing.assert_array_equal(batch.input_ids, [9])  # one decode token: a bucket of one
  np.testing.assert_array_equal(batch.positions[:1], [20])
  np.testing.assert_array_equal(batch.seq_lens[:2], [21, 0])
  np.testing.assert_array_equal(batch.request_distribution, [1, 1, 1])
  assert batch.mamba_state_indices is None and batch.metadata_fields()[0]["mamba_state_indices"] is None
  assert batch.layer_names_per_group == (("layer.0", "layer.3"), ("layer.1", "layer.4"), ("layer.2", "layer.5"))


def test_empty_step_and_request_bucket_above_eight(configs, make_specs):
  cfg = configs["llama"](max_num_seqs=12, max_num_batched_tokens=64)
  scheduler, manager = _setup(cfg, make_specs)
  empty = build_batch(cfg, scheduler.schedule(), manager)
  assert (empty.num_reqs, empty.padded_num_tokens, empty.padded_num_reqs) == (0, 1, 8)
  np.testing.assert_array_equal(empty.query_start_loc, np.zeros(13))
  np.testing.assert_array_equal(empty.request_distribution, [0, 0, 0])
  for i in range(9):
    scheduler.add_request(Request(f"r{i}", [5, 6, 7]))
  batch = build_batch(cfg, scheduler.schedule(), manager)
  assert (batch.padded_num_reqs, batch.padded_num_tokens, max_num_reqs(cfg)) == (12, 32, 12)
  assert batch.seq_lens.shape == (12,) and batch.query_start_loc.shape == (13,)
  assert batch.block_tables[0].shape == (12 * 64,)
  np.testing.assert_array_equal(batch.logits_indices, [2, 5, 8, 11, 14, 17, 20, 23, 26, 0, 0, 0])
  np.testing.assert_array_equal(batch.query_start_loc[9:], [27, 27, 27, 27])


def test_stale_plan_is_rejected(configs, make_specs):
  cfg = configs["llama"]()
  scheduler, manager = _setup(cfg, make_specs)
  scheduler.add_request(Request("a", [5, 6]))
  out = scheduler.schedule()
  scheduler.update_from_output(out, {"a": 7})
  with pytest.raises(ValueError, match="request 'a': num_computed_tokens is 2 but the plan was made at 0"):
    build_batch(cfg, out, manager)


@pytest.mark.parametrize(
    "num_tokens, budget, expected",
    [(0, 256, 16), (1, 256, 16), (16, 256, 16), (17, 256, 32), (129, 256, 256), (100, 100, 128)],
)
def test_token_buckets(num_tokens, budget, expected):
  assert padded_num_tokens(num_tokens, budget) == expected


@pytest.mark.parametrize("num_tokens, min_bucket, expected", [(0, 1, 1), (1, 1, 1), (3, 1, 4), (8, 1, 8), (3, 8, 8)])
def test_token_buckets_below_sixteen(num_tokens, min_bucket, expected):
  """The config's min_token_bucket (1 by default) lets a one-request decode run one token."""
  assert padded_num_tokens(num_tokens, 256, min_bucket) == expected


def test_min_token_bucket_sets_the_smallest_step(configs, make_specs):
  cfg = configs["llama"](min_token_bucket=16)
  scheduler, manager = _setup(cfg, make_specs)
  scheduler.add_request(Request("a", [5, 6, 7]))
  assert build_batch(cfg, scheduler.schedule(), manager).padded_num_tokens == 16


@pytest.mark.parametrize("num_reqs, rows, expected", [(0, 8, 8), (8, 8, 8), (3, 16, 8), (9, 16, 16), (9, 12, 12)])
def test_request_buckets(num_reqs, rows, expected):
  assert padded_num_requests(num_reqs, rows) == expected


def test_bucket_errors_and_powers_of_two():
  with pytest.raises(ValueError, match="257 scheduled tokens exceed max_num_batched_tokens=256"):
    padded_num_tokens(257, 256)
  with pytest.raises(ValueError, match="13 scheduled requests exceed max_num_reqs=12"):
    padded_num_requests(13, 12)
  assert [next_power_of_two(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
