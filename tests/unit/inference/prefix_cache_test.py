"""Prefix caching in the reference runner's scheduler and KV-cache manager, driven with the fake paged model.

The fake model (conftest.py) writes every token into simulated paged caches through the block tables and folds it
into a simulated recurrent state through the state blocks of the recurrent group's table (read the block of the
last computed token, write the block of the last new one), and predicts from what it reads back. A block shared
under a wrong hash, a state resumed from the wrong block, or a resume point where some group holds nothing
changes the tokens or trips an assertion, so every test compares with the runner-free `reference_generate`.
"""

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.inference import SamplingParams
from maxtext.inference.batch import build_batch
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.request import Request, RequestStatus
from maxtext.inference.scheduler import Scheduler

BLOCK = 4


def _cfg(configs, family, **overrides):
  values = {
      "block_size": BLOCK,
      "num_kv_blocks": 64,
      "max_num_batched_tokens": 32,
      "max_target_length": 96,
      "enable_prefix_caching": True,
  }
  values.update(overrides)
  if family == "kvshare":
    return configs["gemma3"](num_kv_shared_layers=2, **values)
  return configs[family](**values)


# (family, overrides): attention-only, sliding windows with and without their own groups, KV sharing, and the
# recurrent align scheme with state blocks of one and of two attention blocks.
CASES = [
    ("llama", {}),
    ("gemma3", {"hybrid_kv_cache": True}),
    ("gemma3", {"hybrid_kv_cache": False}),
    ("kvshare", {}),
    ("qwen3_next", {"hybrid_kv_cache": True}),
    ("qwen3_next", {"hybrid_kv_cache": False, "kv_cache_layout": "layer"}),
    ("qwen3_next", {"mamba_block_size": 2 * BLOCK, "kv_cache_layout": "shuffled"}),
]
IDS = ["llama", "gemma3", "gemma3-one-group", "kvshare", "qwen3_next", "qwen3_next-one-group", "qwen3_next-mbs8"]


class Driver:
  """Scheduler + batch builder + fake model; requests arrive before given steps; checks bookkeeping every step."""

  def __init__(self, cfg, make_specs, paged_fake_model, num_state_slots=None):
    specs, shared = make_specs(cfg)
    self.cfg = cfg
    self.manager = KVCacheManager(cfg, specs, shared, num_state_slots=num_state_slots)
    self.scheduler = Scheduler(cfg, self.manager)
    self.model = paged_fake_model(self.manager)
    self.requests = []

  def add(self, rid, prompt, max_tokens=3):
    """Queues a request now."""
    request = Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    self.scheduler.add_request(request)
    self.requests.append(request)
    return request

  def step(self):
    """One step; returns its plan."""
    out = self.scheduler.schedule()
    batch = build_batch(self.cfg, out, self.manager)
    predictions = self.model.step(batch, out.slots_to_zero)
    self.scheduler.update_from_output(out, {rid: predictions[rid] for rid in out.sampling_request_ids})
    live = [r.request_id for r in self.scheduler.running]
    kv_cache_checks.check_consistency(self.manager, live)
    return out

  def run(self, max_steps=500):
    """Steps until every request finished."""
    for _ in range(max_steps):
      if not self.scheduler.has_unfinished_requests():
        return
      self.step()
    raise AssertionError("the scheduler does not make progress")

  def check(self, reference):
    """Every request gave the runner-free tokens, and nothing leaked."""
    has_recurrent = self.manager.has_recurrent
    for r in self.requests:
      expected, reason = reference(r.prompt_token_ids, r.sampling_params, self.cfg.max_target_length, has_recurrent)
      assert (r.output_token_ids, r.finish_reason) == (expected, reason), r.request_id
      assert r.status == RequestStatus.FINISHED
    assert kv_cache_checks.all_free(self.manager), "blocks or state blocks leaked"


def _tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def _state_unit(cfg):
  return (cfg.mamba_block_size or BLOCK) if cfg.decoder_block == "qwen3_next" else BLOCK


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_repeated_prompt_skips_everything_but_the_last_block(
    configs, make_specs, paged_fake_model, reference, family, overrides
):
  cfg = _cfg(configs, family, **overrides)
  driver = Driver(cfg, make_specs, paged_fake_model)
  prompt = _tokens(0, 18)
  first = driver.add("a", prompt)
  driver.run()
  second = driver.add("b", prompt)
  driver.run()
  driver.check(reference)
  unit = _state_unit(cfg)
  assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 17 // unit * unit)
  assert (driver.scheduler.prefix_cache_queries, driver.scheduler.prefix_cache_hits) == (36, 17 // unit * unit)


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_prompts_sharing_a_prefix_shorter_than_equal_to_and_longer_than_a_block(
    configs, make_specs, paged_fake_model, reference, family, overrides
):
  cfg = _cfg(configs, family, **overrides)
  driver = Driver(cfg, make_specs, paged_fake_model)
  base = _tokens(1, 30)
  driver.add("base", base)
  driver.run()
  shared = {"short": 3, "one-block": BLOCK, "many-blocks": 6 * BLOCK + 1}
  requests = {name: driver.add(name, base[:n] + _tokens(2 + n, 9)) for name, n in shared.items()}
  driver.run()
  driver.check(reference)
  unit = _state_unit(cfg)
  for name, n in shared.items():
    assert requests[name].num_cached_tokens == n // unit * unit, name


@pytest.mark.parametrize("family,overrides", CASES, ids=IDS)
def test_a_request_arriving_while_the_first_still_decodes(
    configs, make_specs, paged_fake_model, reference, family, overrides
):
  cfg = _cfg(configs, family, **overrides)
  driver = Driver(cfg, make_specs, paged_fake_model)
  prompt = _tokens(3, 13)
  first = driver.add("a", prompt, max_tokens=12)
  while len(first.output_token_ids) < 5:
    driver.step()
  # The second request extends the first one's prompt and its first generated tokens.
  second = driver.add("b", first.all_token_ids + (7, 8))
  driver.run()
  driver.check(reference)
  # The first request has computed 17 tokens: 4 full blocks, with a state checkpoint at 16.
  assert second.num_cached_tokens == 16


def test_an_attention_hit_without_a_state_resumes_at_the_last_common_boundary(
    configs, make_specs, paged_fake_model, reference
):
  # State blocks of 8 tokens over attention blocks of 4: 12 shared tokens are 3 cached attention blocks, but the
  # only state checkpoint inside them is at 8.
  cfg = _cfg(configs, "qwen3_next", mamba_block_size=8)
  driver = Driver(cfg, make_specs, paged_fake_model)
  base = _tokens(4, 20)
  driver.add("a", base)
  driver.run()
  probe = base[:12] + _tokens(5, 5)
  hits = driver.manager.group_prefix_hits(probe)
  recurrent = [g.group_id for g in driver.manager.groups if g.kind == "recurrent"]
  assert len(recurrent) == 3  # vLLM's rule: (0, 4), (1, 5), (2, 6)
  attention = {gid: n for gid, n in hits.items() if gid not in recurrent}
  assert attention == dict.fromkeys(driver.manager.attention_group_ids, 12)
  assert [hits[gid] for gid in recurrent] == [8, 8, 8]
  second = driver.add("b", probe)
  driver.run()
  driver.check(reference)
  assert second.num_cached_tokens == 8


def test_evicted_state_blocks_make_the_hit_fall_back_to_zero(configs, make_specs, paged_fake_model, reference):
  # Three usable state blocks: while "a" prefills 20 tokens the checkpoints at 4 and 8 are evicted (LRU), but its
  # attention blocks stay cached. A prompt sharing 10 tokens then has an attention hit of 8 tokens and no state:
  # it must compute from 0 (resuming at 8 would claim a state that no longer exists).
  cfg = _cfg(configs, "qwen3_next")
  driver = Driver(cfg, make_specs, paged_fake_model, num_state_slots=4)
  base = _tokens(6, 20)
  driver.add("a", base, max_tokens=1)
  driver.run()
  probe = base[:10] + _tokens(7, 6)
  hits = driver.manager.group_prefix_hits(probe)
  assert sorted(hits.values()) == [0, 0, 0, 8]  # three recurrent groups, one attention group
  second = driver.add("b", probe)
  third = driver.add("c", base[:17])  # the checkpoint at 16 survived
  driver.run()
  driver.check(reference)
  assert (second.num_cached_tokens, third.num_cached_tokens) == (0, 16)


@pytest.mark.parametrize("family, num_attention_groups", [("llama", 1), ("gemma3", 3), ("qwen3_next", 1)])
def test_eviction_under_cache_pressure_then_a_rehit(
    configs, make_specs, paged_fake_model, reference, family, num_attention_groups
):
  # 12 usable blocks per attention group in the one pool: other prompts evict "a"'s cached blocks; "a" then
  # recomputes, and its repeat hits.
  cfg = _cfg(configs, family, num_kv_blocks=1 + 12 * num_attention_groups, max_target_length=40)
  driver = Driver(cfg, make_specs, paged_fake_model)
  prompt = _tokens(8, 17)
  driver.add("a1", prompt, max_tokens=2)
  driver.run()
  for i in range(3):
    driver.add(f"other{i}", _tokens(20 + i, 17), max_tokens=2)
    driver.run()
  again = driver.add("a2", prompt, max_tokens=2)
  driver.run()
  repeat = driver.add("a3", prompt, max_tokens=2)
  driver.run()
  driver.check(reference)
  assert again.num_cached_tokens < 16 and repeat.num_cached_tokens == 16


def test_concurrent_requests_under_preemption_keep_their_tokens(configs, make_specs, paged_fake_model, reference):
  # Few blocks and shared prefixes: requests preempt each other, re-admissions hit their own cached blocks.
  cfg = _cfg(configs, "qwen3_next", num_kv_blocks=16, max_target_length=48, max_num_batched_tokens=16)
  driver = Driver(cfg, make_specs, paged_fake_model)
  base = _tokens(9, 12)
  for i in range(5):
    driver.add(f"r{i}", base[: 4 + 2 * i] + _tokens(30 + i, 3), max_tokens=8)
  driver.run()
  driver.check(reference)
  assert sum(r.num_preemptions for r in driver.requests) > 0
  assert driver.scheduler.prefix_cache_hits > 0


def test_prefill_chunks_stop_at_every_state_boundary(configs, make_specs, paged_fake_model):
  cfg = _cfg(configs, "qwen3_next", mamba_block_size=8)
  driver = Driver(cfg, make_specs, paged_fake_model)
  driver.add("a", _tokens(10, 21))
  counts = [driver.step().scheduled[0].num_new_tokens for _ in range(4)]
  assert counts == [8, 8, 5, 1]
  plain = Driver(_cfg(configs, "llama"), make_specs, paged_fake_model)
  plain.add("a", _tokens(10, 21))
  assert plain.step().scheduled[0].num_new_tokens == 21


def test_prefix_hit_errors(configs, make_specs):
  cfg = _cfg(configs, "llama")
  specs, shared = make_specs(cfg)
  manager = KVCacheManager(cfg, specs, shared)
  hit = manager.find_prefix_hit(list(range(3, 12)))
  assert hit.num_tokens == 0
  with pytest.raises(ValueError, match="must equal the prefix hit's 0 tokens"):
    manager.allocate_slots("a", 4, 1, hit)
  assert manager.allocate_slots("a", 0, 9, hit)
  with pytest.raises(ValueError, match="applies to a request holding no blocks"):
    manager.allocate_slots("a", 0, 1, hit)
  off = _cfg(configs, "llama", enable_prefix_caching=False)
  manager = KVCacheManager(off, *make_specs(off))
  with pytest.raises(ValueError, match="needs enable_prefix_caching=true"):
    manager.find_prefix_hit([3, 4, 5])
  with pytest.raises(ValueError, match="state block tables exist only"):
    manager.state_block_table("a")
