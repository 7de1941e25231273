"""Prefix caching end to end on every tiny family: greedy tokens with `enable_prefix_caching=true` equal those
without it, under every `kv_cache_layout` and `hybrid_kv_cache` on and off.

One workload per engine (`_workload`) covers: a repeated prompt; prompts sharing a prefix shorter than a block,
exactly a block and many blocks; a request arriving while another still decodes and extending its tokens; cache
pressure that evicts cached blocks, then a re-hit. For the hybrid families it also runs with state blocks of two
attention blocks (`mamba_block_size=8`), where a prefix held by the attention groups but ending between two state
checkpoints must resume from the last common boundary. Each engine without prefix caching is built once per
family (a module-scoped cache) and compared with every engine with it.
"""

import functools

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.inference import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 4
MAX_TOKENS = 4
HYBRIDS = ("qwen3-next-tiny", "qwen3.5-tiny", "granite4-tiny", "bamba-tiny")
# (family, kv_cache_layout, hybrid_kv_cache, mamba_block_size): every layout, and both groupings of the sliding-window
# and of the hybrid families, with both state block sizes (one engine each keeps CI time down; the grouping logic is
# covered per family and grouping by tests/unit/inference/prefix_cache_test.py).
CASES = [
    ("llama-tiny", "hybrid", True, 0),
    ("qwen3-tiny", "shuffled", True, 0),
    ("gemma3-tiny", "layer", False, 0),
    ("kvshare-tiny", "hybrid", True, 0),
    ("qwen3-next-tiny", "layer", False, 2 * BLOCK),
    ("qwen3.5-tiny", "shuffled", True, 0),
    ("granite4-tiny", "layer", True, 2 * BLOCK),
    ("bamba-tiny", "hybrid", False, 0),
    ("gpt-oss-tiny", "shuffled", True, 0),
]


def _tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


# 39 usable blocks per attention group in the one pool: kvshare-tiny with hybrid_kv_cache has four one-layer groups.
NUM_KV_BLOCKS = {"kvshare-tiny": 1 + 39 * 4}


def _llm(name, apc, layout="hybrid", hybrid=True, mamba_block_size=0):
  return LLM(
      model_name=name,
      kv_cache_layout=layout,
      hybrid_kv_cache=hybrid,
      enable_prefix_caching=apc,
      mamba_block_size=mamba_block_size,
      block_size=BLOCK,
      num_kv_blocks=NUM_KV_BLOCKS.get(name, 40) if hybrid else 40,
      max_num_batched_tokens=32,
      min_token_bucket=32,  # one token bucket: one compiled step per engine
      max_num_seqs=4,
      max_target_length=64,
      seed=3,
  )


def _cached_tokens(llm, outs):
  """Tokens of the finished requests `outs` (prompt and output) that the prefix cache still holds, summed over the
  requests and the KV-cache groups (0 without prefix caching)."""
  manager = llm.engine.manager
  if not manager.enable_prefix_caching:
    return 0
  # One token more than each request computed, so that every block it wrote is within the looked-up prefix.
  sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + [0] for o in outs]
  return sum(sum(manager.group_prefix_hits(seq).values()) for seq in sequences)


def _workload(llm):
  """Runs the workload; returns (tokens per request, cached tokens per request), in the order listed below, and
  whether the cache-pressure round evicted cached blocks of the earlier requests."""
  params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
  base = _tokens(0, 21)
  outs = llm.generate([base], params)
  # Shares 3 tokens (less than a block), 4 (a block), 13 (three blocks and a token), all 21 (a repeat).
  outs += llm.generate([base[:3] + _tokens(1, 6), base[:4] + _tokens(2, 6), base[:13] + _tokens(3, 4), base], params)
  held = _cached_tokens(llm, outs)
  # Cache pressure: four 24-token requests need 28 of the 39 blocks at once, evicting cached ones; then re-hits.
  num_earlier = len(outs)
  outs += llm.generate([_tokens(10 + i, 24) for i in range(4)], params)
  evicted = _cached_tokens(llm, outs[:num_earlier]) < held
  outs += llm.generate([base], params)
  outs += llm.generate([base], params)
  # A second request arrives while the first decodes, extending the first one's prompt and first outputs.
  engine = llm.engine
  first = engine.add_request(_tokens(4, 10), SamplingParams(temperature=0.0, max_tokens=8))
  finished = {}
  while not engine.scheduler.running or len(engine.scheduler.running[0].output_token_ids) < 3:
    finished.update((f.request_id, f) for f in engine.step())
  second = engine.add_request(list(engine.scheduler.running[0].all_token_ids) + [9, 9], params)
  while engine.has_unfinished_requests():
    finished.update((f.request_id, f) for f in engine.step())
  assert kv_cache_checks.all_free(engine.manager), "blocks or state blocks leaked"
  kv_cache_checks.check_consistency(engine.manager, [])
  tokens = [list(o.outputs[0].token_ids) for o in outs] + [list(finished[r].output_token_ids) for r in (first, second)]
  cached = [o.num_cached_tokens for o in outs] + [finished[r].num_cached_tokens for r in (first, second)]
  return tokens, cached, evicted


@functools.lru_cache(maxsize=None)
def _without_prefix_caching(name):
  return _workload(_llm(name, False))


@pytest.mark.parametrize("name,layout,hybrid,mamba_block_size", CASES)
def test_prefix_caching_gives_the_same_greedy_tokens(name, layout, hybrid, mamba_block_size):
  llm = _llm(name, True, layout, hybrid, mamba_block_size)
  tokens, cached, evicted = _workload(llm)
  expected, none_cached, _ = _without_prefix_caching(name)
  assert tokens == expected
  assert not any(none_cached)
  unit = (mamba_block_size or BLOCK) if name in HYBRIDS else BLOCK

  def boundary(n):
    return n // unit * unit

  # base; its three prefix-sharing prompts and its repeat (the 13-token prefix holds 3 attention blocks but, with
  # 8-token state blocks, its last common state boundary is at 8); the eviction round; the first re-hit after
  # eviction, then a full one; the request decoding, and the one arriving meanwhile (12 tokens computed by then).
  assert cached[:5] == [0, 0, boundary(4), boundary(12), boundary(20)]
  assert cached[5:9] == [0, 0, 0, 0]
  assert cached[9] <= boundary(20) and cached[9] % unit == 0
  assert cached[10:] == [boundary(20), 0, boundary(12)]
  stats = llm.engine.stats.as_dict()
  assert stats["prefix_cache_hits"] == sum(cached)
  assert stats["prefix_cache_queries"] > stats["prefix_cache_hits"]
  assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"] / stats["prefix_cache_queries"])
  assert evicted
