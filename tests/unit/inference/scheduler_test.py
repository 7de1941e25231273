"""Tests of the continuous-batching scheduler (driven with a fake paged model, see conftest.py)."""

import types

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.configs.errors import ConfigError
from maxtext.inference import SamplingParams
from maxtext.inference.batch import build_batch
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.request import Request, RequestStatus
from maxtext.inference.scheduler import Scheduler


def _scheduler(cfg, make_specs, **kwargs):
  specs, shared = make_specs(cfg)
  return Scheduler(cfg, KVCacheManager(cfg, specs, shared), **kwargs)


def _plan(out):
  return [(r.request_id, n) for r, n in out.scheduled]


def _random_requests(rng, count, max_prompt, max_new):
  requests = []
  for i in range(count):
    prompt = rng.integers(3, 259, size=int(rng.integers(1, max_prompt + 1))).tolist()
    requests.append(
        Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, max_new + 1))))
    )
  return requests


def _check_against_reference(requests, reference, cfg, has_recurrent, eos_token_id=None):
  for request in requests:
    expected, reason = reference(
        request.prompt_token_ids, request.sampling_params, cfg.max_target_length, has_recurrent, eos_token_id
    )
    assert request.output_token_ids == expected, request.request_id
    assert (request.finish_reason, request.status) == (reason, RequestStatus.FINISHED)


def test_decodes_first_then_running_prefills_then_waiting(configs, make_specs):
  scheduler = _scheduler(configs["llama"](max_num_batched_tokens=32), make_specs)
  a, b, c = Request("a", [5, 6]), Request("b", list(range(10, 50))), Request("c", list(range(60, 90)))
  for request in (a, b, c):
    scheduler.add_request(request)
  out = scheduler.schedule()
  assert _plan(out) == [("a", 2), ("b", 30)] and out.sampling_request_ids == ("a",)
  scheduler.update_from_output(out, {"a": 7})
  out = scheduler.schedule()
  assert _plan(out) == [("a", 1), ("b", 10), ("c", 21)] and out.sampling_request_ids == ("a", "b")
  assert out.num_decodes == 1 and out.num_scheduled_tokens == 32
  scheduler.update_from_output(out, {"a": 8, "b": 9})
  scheduler.add_request(Request("d", [4]))
  out = scheduler.schedule()
  # d is admitted last but computes one token, so it joins the decodes ahead of c's prefill.
  assert _plan(out) == [("a", 1), ("b", 1), ("d", 1), ("c", 9)]
  assert out.sampling_request_ids == ("a", "b", "d", "c") and out.num_decodes == 3


def test_chunked_prefill_samples_only_when_the_prompt_is_done(configs, make_specs):
  scheduler = _scheduler(configs["llama"](max_num_batched_tokens=8), make_specs)
  request = Request("a", list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=2))
  scheduler.add_request(request)
  plans = []
  for token in (None, None, 11, 12):
    out = scheduler.schedule()
    plans.append((_plan(out), out.sampling_request_ids))
    assert not scheduler.update_from_output(out, {} if token is None else {"a": token}) or token == 12
  assert plans == [([("a", 8)], ()), ([("a", 8)], ()), ([("a", 4)], ("a",)), ([("a", 1)], ("a",))]
  assert request.output_token_ids == [11, 12] and request.finish_reason == "length"
  assert not scheduler.has_unfinished_requests() and scheduler.schedule().is_empty


def test_max_num_seqs_limits_running_requests(configs, run, reference):
  cfg = configs["llama"](max_num_seqs=2, max_num_batched_tokens=64)
  requests = [Request(f"r{i}", [10 + i] * 4, SamplingParams(temperature=0.0, max_tokens=3)) for i in range(3)]
  outputs, running_before, manager = run(cfg, requests)
  assert _plan(outputs[0]) == [("r0", 4), ("r1", 4)]
  assert max(len(r) for r in running_before) == 2
  _check_against_reference(requests, reference, cfg, False)
  assert kv_cache_checks.all_free(manager)


@pytest.mark.parametrize("model", ["llama", "qwen3_next"])
def test_preemption_takes_the_newest_and_every_request_completes(configs, run, reference, model):
  cfg = configs[model](block_size=4, num_kv_blocks=9, max_num_batched_tokens=16, max_num_seqs=4)
  rng = np.random.default_rng(7)
  requests = [
      Request(f"r{i}", rng.integers(3, 259, size=6 + i).tolist(), SamplingParams(temperature=0.0, max_tokens=12))
      for i in range(4)
  ]
  outputs, running_before, manager = run(cfg, requests)
  preempting = [(out, before) for out, before in zip(outputs, running_before) if out.preempted_request_ids]
  assert preempting, "the pool is small enough that some request must be preempted"
  for out, before in preempting:
    newest_first = before[::-1]
    assert list(out.preempted_request_ids) == newest_first[: len(out.preempted_request_ids)]
  assert sum(r.num_preemptions for r in requests) >= 1 and requests[0].num_preemptions == 0
  _check_against_reference(requests, reference, cfg, model == "qwen3_next")
  assert kv_cache_checks.all_free(manager)


@pytest.mark.parametrize(
    "model, overrides",
    [
        ("llama", {"num_kv_blocks": 8}),
        # Four one-layer attention groups (two of them reading shared layers) draw from one pool: 7 usable each.
        ("gemma3", {"num_kv_shared_layers": 2, "num_kv_blocks": 29}),
        ("gemma3", {"hybrid_kv_cache": False, "num_kv_blocks": 8}),
        ("qwen3_next", {"kv_cache_layout": "shuffled", "num_kv_blocks": 8}),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_match_the_reference_and_leak_nothing(configs, run, reference, model, overrides, seed):
  cfg = configs[model](block_size=4, max_num_batched_tokens=12, max_num_seqs=3, max_target_length=24, **overrides)
  rng = np.random.default_rng(seed)
  requests = _random_requests(rng, 7, max_prompt=14, max_new=10)
  for request in requests[::2]:  # stop early at a token the request would generate
    params = request.sampling_params
    expected, _ = reference(request.prompt_token_ids, params, cfg.max_target_length, model == "qwen3_next")
    stop = (expected[int(rng.integers(0, len(expected)))],)
    request.sampling_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, stop_token_ids=stop)
  # 2 state slots for 3 sequences: admission also waits for slots (even seeds); 3 slots: only blocks limit.
  outputs, _, manager = run(cfg, requests, num_state_slots=3 + seed % 2)
  assert any(out.preempted_request_ids for out in outputs), "the pool is small enough to force preemption"
  _check_against_reference(requests, reference, cfg, model == "qwen3_next")
  assert kv_cache_checks.all_free(manager)


def test_waiting_request_waits_for_blocks(configs, run, reference):
  cfg = configs["llama"](block_size=4, num_kv_blocks=5, max_num_batched_tokens=32)
  requests = [
      Request("a", list(range(3, 15)), SamplingParams(temperature=0.0, max_tokens=4)),
      Request("b", list(range(3, 11)), SamplingParams(temperature=0.0, max_tokens=4)),
  ]
  outputs, _, manager = run(cfg, requests)
  assert _plan(outputs[0]) == [("a", 12)] and not outputs[0].preempted_request_ids
  first_b = next(i for i, out in enumerate(outputs) if "b" in [r.request_id for r, _ in out.scheduled])
  assert first_b == 4  # after a's 4 tokens are generated and a is freed
  _check_against_reference(requests, reference, cfg, False)
  assert kv_cache_checks.all_free(manager)


def test_finish_reasons(configs, run, reference):
  cfg = configs["llama"](max_target_length=8)
  prompt = [3, 4, 5, 6, 7]
  first, _ = reference(prompt, SamplingParams(temperature=0.0, max_tokens=1), 8, False)
  requests = [
      Request("stop", prompt, SamplingParams(temperature=0.0, stop_token_ids=(first[0],))),
      Request("length", prompt, SamplingParams(temperature=0.0, max_tokens=100)),
      Request("max_tokens", prompt, SamplingParams(temperature=0.0, max_tokens=2)),
  ]
  run(cfg, requests)
  assert [(r.finish_reason, len(r.output_token_ids)) for r in requests] == [("stop", 1), ("length", 3), ("length", 2)]
  eos = Request("eos", prompt)
  run(cfg, [eos], eos_token_id=first[0])
  assert (eos.finish_reason, eos.output_token_ids) == ("stop", first)


def test_add_request_validation(configs, make_specs):
  scheduler = _scheduler(configs["llama"](max_target_length=16, block_size=4, num_kv_blocks=4), make_specs)
  with pytest.raises(TypeError, match="add_request needs a Request, got list"):
    scheduler.add_request([1, 2])
  with pytest.raises(ValueError, match="request 'e': the prompt is empty"):
    scheduler.add_request(Request("e", []))
  for token in (512, -1, True, 2.0):
    with pytest.raises(ValueError, match=r"request 't': prompt token .* must be an int in \[0, vocab_size=512\)"):
      scheduler.add_request(Request("t", [5, token]))
  with pytest.raises(ValueError, match="the prompt has 16 tokens but must be shorter than max_target_length=16"):
    scheduler.add_request(Request("long", [5] * 16))
  with pytest.raises(ValueError, match="request 'big': 14 tokens need 4 blocks in group 0"):
    scheduler.add_request(Request("big", [5] * 10, SamplingParams(temperature=0.0, max_tokens=5)))
  scheduler.add_request(Request("ok", [np.int64(5)] * 12, SamplingParams(temperature=0.0, max_tokens=1)))
  with pytest.raises(ValueError, match="request 'ok': an unfinished request with this id already exists"):
    scheduler.add_request(Request("ok", [5]))
  used = Request("used", [5], output_token_ids=[6])
  with pytest.raises(ValueError, match="request 'used': must be new"):
    scheduler.add_request(used)
  assert scheduler.num_unfinished_requests == 1
  assert scheduler.waiting[0].prompt_token_ids == (5,) * 12 and isinstance(scheduler.waiting[0].prompt_token_ids[0], int)


def test_request_that_can_never_fit_raises_instead_of_looping(configs, make_specs):
  # Only sliding layers (window 8): admission cannot reject by length, so the scheduler finds out while running.
  sliding = {"base_num_decoder_layers": 2, "layer_types": ["sliding_attention"] * 2, "block_size": 4, "num_kv_blocks": 4}
  scheduler = _scheduler(configs["gemma3"](max_num_batched_tokens=64, **sliding), make_specs)
  scheduler.add_request(Request("a", [5] * 40))
  with pytest.raises(
      RuntimeError, match=r"request 'a' can never fit: computing tokens \[0, 40\) fails .*3 of 3 blocks free"
  ):
    scheduler.schedule()
  scheduler = _scheduler(configs["gemma3"](max_num_batched_tokens=8, **sliding), make_specs)
  scheduler.add_request(Request("a", [5] * 40))
  scheduler.update_from_output(scheduler.schedule(), {})
  with pytest.raises(RuntimeError, match=r"request 'a' can never fit: computing tokens \[8, 16\)"):
    scheduler.schedule()


def test_state_slots_are_reported_for_zeroing(configs, make_specs):
  scheduler = _scheduler(configs["qwen3_next"](), make_specs)
  manager = scheduler.kv_cache_manager
  scheduler.add_request(Request("a", [5, 6], SamplingParams(temperature=0.0, max_tokens=1)))
  scheduler.add_request(Request("b", [7, 8], SamplingParams(temperature=0.0, max_tokens=2)))
  out = scheduler.schedule()
  assert (manager.get_state_slot("a"), manager.get_state_slot("b"), out.slots_to_zero) == (1, 2, ())
  finished = scheduler.update_from_output(out, {"a": 9, "b": 10})
  assert [r.request_id for r in finished] == ["a"] and not manager.has_request("a")
  scheduler.add_request(Request("c", [11]))
  out = scheduler.schedule()
  assert out.slots_to_zero == (1,) and manager.get_state_slot("c") == 1


def test_update_from_output_validation(configs, make_specs):
  scheduler = _scheduler(configs["llama"](), make_specs)
  scheduler.add_request(Request("a", [5, 6]))
  out = scheduler.schedule()
  with pytest.raises(ValueError, match=r"missing \['a'\], unexpected \[\]"):
    scheduler.update_from_output(out, {})
  with pytest.raises(ValueError, match=r"missing \[\], unexpected \['x'\]"):
    scheduler.update_from_output(out, {"a": 5, "x": 6})
  with pytest.raises(ValueError, match=r"request 'a': sampled token 512 must be an int in \[0, vocab_size=512\)"):
    scheduler.update_from_output(out, {"a": 512})
  assert scheduler.running[0].num_computed_tokens == 0  # nothing applied by the failed calls
  scheduler.update_from_output(out, {"a": np.int32(7)})
  assert scheduler.running[0].output_token_ids == [7] and isinstance(scheduler.running[0].output_token_ids[0], int)
  with pytest.raises(ValueError, match="request 'a': this scheduler output is stale"):
    scheduler.update_from_output(out, {"a": 7})


def _step(scheduler, token=100):
  """Schedules one step and samples `token` for every sampling request; returns the plan."""
  out = scheduler.schedule()
  scheduler.update_from_output(out, {rid: token for rid in out.sampling_request_ids})
  return out


@pytest.mark.parametrize("prefix_caching, resumed_at, recomputed", [(True, 8, 4), (False, 0, 12)])
def test_preemption_recomputes_only_what_the_prefix_cache_lost(
    configs, make_specs, prefix_caching, resumed_at, recomputed
):
  # 6 usable blocks of 4 tokens. a and b (8-token prompts) prefill in step 1, decode to 12 computed tokens each
  # (3 blocks each: the pool is full) by step 5; in step 6 a needs a 4th block, so b (newest) is preempted with 12
  # tokens computed. Under prefix caching b's 3 full blocks stay cached, freed last first, so a's new block evicts
  # b's third block (tokens 8-11) and b's first two survive. b cannot come back while a runs (it needs 4 blocks);
  # a (max_tokens 9: at most 16 cached tokens, 4 blocks) finishes in step 9, and in step 10 b resumes from its 8
  # cached tokens and computes 8..12 (5 tokens, of which 8-11 again: 4), or without prefix caching all 13 from 0.
  cfg = configs["llama"](
      block_size=4, num_kv_blocks=7, max_num_batched_tokens=32, max_target_length=64, enable_prefix_caching=prefix_caching
  )
  scheduler = _scheduler(cfg, make_specs)
  a = Request("a", list(range(3, 11)), SamplingParams(temperature=0.0, max_tokens=9))
  b = Request("b", list(range(20, 28)), SamplingParams(temperature=0.0, max_tokens=10))
  scheduler.add_request(a)
  scheduler.add_request(b)
  plans = [_step(scheduler) for _ in range(10)]
  assert [p.preempted_request_ids for p in plans] == [()] * 5 + [("b",)] + [()] * 4
  assert b.num_preemptions == 1 and a.status == RequestStatus.FINISHED and a.finish_reason == "length"
  assert [_plan(p) for p in plans[6:9]] == [[("a", 1)]] * 3, "b waits while a runs"
  assert _plan(plans[9]) == [("b", 13 - resumed_at)] and plans[9].num_computed_tokens["b"] == resumed_at
  assert scheduler.recomputed_tokens == recomputed
  while scheduler.has_unfinished_requests():
    _step(scheduler)
  assert scheduler.recomputed_tokens == recomputed, "nothing after the resume is counted"
  assert len(b.output_token_ids) == 10


def _drive(cfg, requests, make_specs, paged_fake_model):
  """Runs the requests with the fake paged model; returns the scheduler and the resume points of preempted
  requests (num_computed_tokens in the plan that readmits them)."""
  specs, shared = make_specs(cfg)
  manager = KVCacheManager(cfg, specs, shared)
  scheduler = Scheduler(cfg, manager)
  model = paged_fake_model(manager)
  for request in requests:
    scheduler.add_request(request)
  resumed, scheduled = [], 0
  for _ in range(2000):
    if not scheduler.has_unfinished_requests():
      break
    preempted = {r.request_id for r in scheduler.waiting if r.num_preemptions}
    out = scheduler.schedule()
    resumed += [out.num_computed_tokens[r.request_id] for r, _ in out.scheduled if r.request_id in preempted]
    scheduled += out.num_scheduled_tokens
    predictions = model.step(build_batch(cfg, out, manager), out.slots_to_zero)
    scheduler.update_from_output(out, {rid: predictions[rid] for rid in out.sampling_request_ids})
  assert not scheduler.has_unfinished_requests() and kv_cache_checks.all_free(manager)
  return scheduler, resumed, scheduled


def _tight_pool_workload(make_config, pool, *, seed, num_requests, prompt_len, max_tokens, **keys):
  """A config of `pool` blocks of 4 tokens (4 seats, 16-token steps, 48-token context) and `num_requests` greedy
  requests of random prompts: the workload of the preemption and admission tests."""
  cfg = make_config(
      block_size=4, num_kv_blocks=pool, max_num_batched_tokens=16, max_num_seqs=4, max_target_length=48, **keys
  )
  rng = np.random.default_rng(seed)
  requests = [
      Request(
          f"r{i}", rng.integers(3, 259, size=prompt_len).tolist(), SamplingParams(temperature=0.0, max_tokens=max_tokens)
      )
      for i in range(num_requests)
  ]
  return cfg, requests


@pytest.mark.parametrize("model", ["llama", "gemma3", "qwen3_next"])
def test_a_preempted_request_resumes_from_its_cached_blocks_with_the_same_tokens(
    configs, make_specs, paged_fake_model, reference, model
):
  # A pool that forces preemptions. With prefix caching some re-admission starts from cached blocks
  # (num_computed_tokens > 0 in its plan) and fewer tokens are computed again; the tokens are the reference's.
  # No prompt shares a block with another, so every token computed beyond each request's own
  # prompt + outputs - 1 was computed again: the counter must equal that excess.
  pool = {"llama": 13, "gemma3": 27, "qwen3_next": 13}[model]
  recomputed = {}
  for prefix_caching in (False, True):
    cfg, requests = _tight_pool_workload(
        configs[model], pool, seed=11, num_requests=4, prompt_len=14, max_tokens=16, enable_prefix_caching=prefix_caching
    )
    scheduler, resumed, scheduled = _drive(cfg, requests, make_specs, paged_fake_model)
    assert resumed, "the pool is small enough that some request is preempted and resumed"
    assert any(n > 0 for n in resumed) == prefix_caching, resumed
    assert scheduler.recomputed_tokens == scheduled - sum(r.num_tokens - 1 for r in requests) > 0
    _check_against_reference(requests, reference, cfg, model == "qwen3_next")
    recomputed[prefix_caching] = scheduler.recomputed_tokens
  assert recomputed[True] < recomputed[False], recomputed


@pytest.mark.parametrize(
    "reserve, first_plan", [("none", [("a", 4), ("b", 4), ("c", 4), ("d", 4)]), ("max_tokens", [("a", 4), ("b", 4)])]
)
def test_admission_reserve_admits_only_what_can_grow_to_max_tokens(configs, run, reference, reserve, first_plan):
  # 8 usable blocks of 4 tokens; each request (4 prompt tokens, max_tokens 12) ends holding 15 tokens: 4 blocks.
  # vLLM's rule admits all four at once (a block each) and they preempt each other as they grow. The reserve
  # admits a (nothing runs), then b (a's 3 more + b's 4 = 7 <= 7 free), not c (3 + 3 + 4 = 10 > 6 free).
  cfg = configs["llama"](
      block_size=4, num_kv_blocks=9, max_num_batched_tokens=16, max_num_seqs=4, admission_reserve=reserve
  )
  requests = [Request(rid, [10 + i] * 4, SamplingParams(temperature=0.0, max_tokens=12)) for i, rid in enumerate("abcd")]
  outputs, _, manager = run(cfg, requests)
  assert _plan(outputs[0]) == first_plan
  preemptions = sum(r.num_preemptions for r in requests)
  assert preemptions > 0 if reserve == "none" else preemptions == 0
  _check_against_reference(requests, reference, cfg, False)
  assert kv_cache_checks.all_free(manager)


@pytest.mark.parametrize("model", ["gemma3", "qwen3_next"])
def test_admission_reserve_stops_preemptions_with_sliding_windows_and_recurrent_layers(configs, run, reference, model):
  # Sliding-window groups are reserved up to a window's blocks, recurrent groups not at all: the same pool that
  # makes the default preempt runs every request without a preemption, with the same tokens.
  pool = {"gemma3": 31, "qwen3_next": 13}[model]
  counts = {}
  for reserve in ("none", "max_tokens"):
    cfg, requests = _tight_pool_workload(
        configs[model], pool, seed=5, num_requests=6, prompt_len=10, max_tokens=20, admission_reserve=reserve
    )
    _, _, manager = run(cfg, requests)
    counts[reserve] = sum(r.num_preemptions for r in requests)
    _check_against_reference(requests, reference, cfg, model == "qwen3_next")
    assert kv_cache_checks.all_free(manager)
  assert counts["none"] > 0 and counts["max_tokens"] == 0, counts


def test_blocks_to_grow_counts_full_groups_to_the_end_and_sliding_groups_to_a_window(configs, make_specs):
  # gemma3: two sliding groups (window 8: at most cdiv(7, 4) + 1 = 3 blocks each) and one full group, blocks of 4.
  cfg = configs["gemma3"](block_size=4, num_kv_blocks=40, enable_prefix_caching=True)
  specs, shared = make_specs(cfg)
  manager = KVCacheManager(cfg, specs, shared)
  assert manager.blocks_to_grow("a", 15) == 4 + 2 * 3
  assert manager.blocks_to_grow("a", 6) == 2 + 2 * 2
  assert manager.allocate_slots("a", 0, 9)  # 3 blocks in every group
  assert manager.blocks_to_grow("a", 15) == 1 + 2 * 0
  manager.cache_blocks("a", list(range(3, 12)), 9)  # blocks 0 and 1 of every group are full and cached
  hit = manager.find_prefix_hit(list(range(3, 12)))
  assert hit.num_tokens == 8
  # a holds the hit's blocks, so a new request with that hit takes only what it lacks ...
  assert manager.blocks_to_grow("b", 15, hit) == (4 - 2) + 2 * (3 - 2)
  manager.free("a")
  # ... but once they are free (cached, evictable) taking them back uses free blocks too.
  assert manager.blocks_to_grow("b", 15, hit) == 4 + 2 * 3
  # A step of 16 tokens over 3 requests reaches at most 16 / 4 + 3 blocks past the windows, in each sliding group.
  assert manager.window_spill_blocks(16, 3) == 2 * (4 + 3) and manager.window_spill_blocks(1, 1) == 2 * (1 + 1)
  plain = configs["llama"](block_size=4)
  assert KVCacheManager(plain, *make_specs(plain)).window_spill_blocks(16, 3) == 0


def test_admission_reserve_must_be_a_known_rule(configs, make_specs):
  with pytest.raises(ConfigError, match=r"^admission_reserve='always': must be one of none, max_tokens$"):
    configs["llama"](admission_reserve="always")
  cfg = types.SimpleNamespace(**dict(configs["llama"]().items(), admission_reserve="max-tokens"))
  with pytest.raises(ValueError, match=r"admission_reserve='max-tokens': must be one of none, max_tokens"):
    _scheduler(cfg, make_specs)
