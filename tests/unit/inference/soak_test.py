"""Soak test of the reference runner: hundreds of random requests with random lengths, sampling settings,
arrivals, aborts and invalid requests on the hybrid families, with the books checked after every step.

Two drivers, same workload generator:
  - scheduler + KV-cache manager + batch builder with the paged fake model of conftest.py (no JAX, so many
    requests and steps): every request's tokens must equal `reference_generate`, the fake model's tokens for the
    prompt alone, and an aborted request's tokens must be a prefix of them;
  - `LLMEngine` with the real tiny models: every request's tokens (greedy and seeded sampling) must equal the same
    request run alone in the same engine afterwards, logprobs included.
After every step: `kv_cache_checks.check_consistency` (reference counts equal block-table entries, every other
block free, no state slot held by two live requests, only live requests hold anything), the step's tokens within
`max_num_batched_tokens`, at most `max_num_seqs` requests, no preempted request scheduled; at the end every block
and slot is free. `SOAK_SEED=<n>` reruns with another seed; each run prints its figures (see docs/reliability.md).
"""

import collections
import dataclasses
import os

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.configs import load_config
from maxtext.inference import SamplingParams
from maxtext.inference.batch import build_batch
from maxtext.inference.engine import LLMEngine
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.request import Request
from maxtext.inference.scheduler import Scheduler
from maxtext.kv_cache import kv_cache_spec

SEED = int(os.environ.get("SOAK_SEED", "0"))
FAMILIES = ["qwen3-next-tiny", "qwen3.5-tiny", "gemma3-tiny", "kvshare-tiny"]
# 11 usable blocks of 4 tokens per attention group for up to 4 requests of up to 40 tokens: preemption is frequent.
RUNNER = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
MAX_TARGET_LENGTH = 40
# Fewer layers where the family's pattern survives it (one [lin, lin, lin, full] / [slide, slide, full] cycle),
# so the real-model soak compiles and steps faster; kvshare-tiny needs its 6 layers for the shared pair.
SHAPES = {
    "qwen3-next-tiny": {"base_num_decoder_layers": 4},
    "qwen3.5-tiny": {"base_num_decoder_layers": 4},
    "gemma3-tiny": {"base_num_decoder_layers": 3},
    "kvshare-tiny": {},
}
# Attention groups by vLLM's rule: one (qwen); gemma3 [s, s, f]: three of one layer; kvshare-tiny: four.
NUM_ATTENTION_GROUPS = {"qwen3-next-tiny": 1, "qwen3.5-tiny": 1, "gemma3-tiny": 3, "kvshare-tiny": 4}


@dataclasses.dataclass
class Figures:
  """What one soak run did."""

  requests: int = 0
  steps: int = 0
  preemptions: int = 0
  aborts: int = 0
  rejected: int = 0
  checks: int = 0
  leaks: int = 0

  def line(self, name):
    """The figures as one printable line."""
    return (
        f"soak {name} seed={SEED}: {self.requests} requests, {self.steps} steps, {self.preemptions} preemptions,"
        f" {self.aborts} aborts, {self.rejected} invalid requests rejected, {self.checks} invariant checks,"
        f" {self.leaks} leaks"
    )


def _config(name):
  blocks = 1 + 11 * NUM_ATTENTION_GROUPS[name]
  return load_config(
      model_name=name, max_target_length=MAX_TARGET_LENGTH, seed=SEED, num_kv_blocks=blocks, **RUNNER, **SHAPES[name]
  )


def _random_params(rng, sampling):
  kw = {"max_tokens": int(rng.integers(1, 11)), "temperature": 0.0}
  if rng.random() < 0.2:
    kw["stop_token_ids"] = tuple(int(t) for t in rng.integers(3, 512, 3))
  if sampling and rng.random() < 0.5:
    kw.update(
        temperature=float(rng.choice([0.5, 0.9, 1.3])),
        top_k=int(rng.choice([-1, 5, 50])),
        top_p=float(rng.choice([1.0, 0.9])),
        seed=int(rng.integers(0, 2**31)),
    )
  if sampling and rng.random() < 0.3:
    kw["logprobs"] = int(rng.integers(0, 3))
  return SamplingParams(**kw)


def _invalid_prompt(rng, vocab_size):
  kind = int(rng.integers(0, 3))
  if kind == 0:
    return []
  if kind == 1:
    return [5, vocab_size]
  return [7] * MAX_TARGET_LENGTH


class _Workload:
  """Random arrivals, aborts and invalid requests, drawn from one seeded generator."""

  def __init__(self, rng, num_requests, sampling):
    self.rng = rng
    self.pending = [
        (rng.integers(3, 512, int(rng.integers(1, 33))).tolist(), _random_params(rng, sampling))
        for _ in range(num_requests)
    ]
    self.pending.reverse()

  def arrivals(self):
    """0 to 2 new requests for this step."""
    count = min(len(self.pending), int(self.rng.integers(0, 3)))
    return [self.pending.pop() for _ in range(count)]

  def wants_invalid(self):
    """Whether to submit an invalid request this step."""
    return self.rng.random() < 0.05

  def victim(self, unfinished_ids):
    """The request to abort this step, or None."""
    if unfinished_ids and self.rng.random() < 0.08:
      return sorted(unfinished_ids)[int(self.rng.integers(0, len(unfinished_ids)))]
    return None


def _check_step(cfg, out, scheduler, figures):
  counts = [n for _, n in out.scheduled]
  assert sum(counts) <= cfg.max_num_batched_tokens and len(counts) <= cfg.max_num_seqs, counts
  assert len(scheduler.running) <= cfg.max_num_seqs
  assert not set(out.preempted_request_ids) & {r.request_id for r, _ in out.scheduled}
  kv_cache_checks.check_consistency(scheduler.kv_cache_manager, {r.request_id for r in scheduler.running})
  figures.preemptions += len(out.preempted_request_ids)
  figures.checks += 1


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_soak_scheduler_with_the_paged_fake_model(name, paged_fake_model, reference):
  cfg = _config(name)
  manager = KVCacheManager(cfg, kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg))
  scheduler = Scheduler(cfg, manager)
  model = paged_fake_model(manager)
  rng = np.random.default_rng([SEED, FAMILIES.index(name)])
  workload = _Workload(rng, 500, sampling=False)
  figures = Figures()
  requests, aborted = {}, set()
  while workload.pending or scheduler.has_unfinished_requests():
    assert figures.steps < 20000, "no progress"
    for prompt, params in workload.arrivals():
      request = Request(f"r{figures.requests}", prompt, params)
      scheduler.add_request(request)
      requests[request.request_id] = request
      figures.requests += 1
    if workload.wants_invalid():
      with pytest.raises(ValueError):
        scheduler.add_request(Request(f"bad{figures.rejected}", _invalid_prompt(rng, cfg.vocab_size)))
      figures.rejected += 1
    victim = workload.victim([rid for rid in requests if scheduler.is_unfinished(rid)])
    if victim is not None:
      scheduler.abort_request(victim)
      aborted.add(victim)
      figures.aborts += 1
    out = scheduler.schedule()
    _check_step(cfg, out, scheduler, figures)
    if out.is_empty:
      for slot in out.slots_to_zero:  # released slots are zeroed even when the step runs nothing
        model.states[slot] = 0
      continue
    predictions = model.step(build_batch(cfg, out, manager), out.slots_to_zero)
    scheduler.update_from_output(out, {rid: predictions[rid] for rid in out.sampling_request_ids})
    kv_cache_checks.check_consistency(scheduler.kv_cache_manager, {r.request_id for r in scheduler.running})
    figures.steps += 1
  figures.leaks = int(not kv_cache_checks.all_free(manager))
  print(figures.line(f"{name} (scheduler, fake model)"))
  assert figures.leaks == 0
  assert figures.preemptions > 0 and figures.aborts > 0 and figures.rejected > 0
  has_recurrent = "linear_attention" in cfg.layer_types
  for rid, request in requests.items():
    expected, reason = reference(request.prompt_token_ids, request.sampling_params, cfg.max_target_length, has_recurrent)
    if rid in aborted:
      assert request.output_token_ids == expected[: len(request.output_token_ids)], (SEED, rid)
    else:
      assert (request.output_token_ids, request.finish_reason) == (expected, reason), (SEED, rid)


def _run_alone(engine, prompt, params):
  rid = engine.add_request(prompt, params)
  done = {}
  while engine.has_unfinished_requests():
    done.update({f.request_id: f for f in engine.step()})
  return done[rid]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_soak_engine_with_the_real_model(name):
  cfg = _config(name)
  engine = LLMEngine(cfg)
  outputs = []
  real_schedule = engine.scheduler.schedule

  def schedule():
    outputs.append(real_schedule())
    return outputs[-1]

  engine.scheduler.schedule = schedule  # records every plan for the budget checks
  rng = np.random.default_rng([SEED, 100 + FAMILIES.index(name)])
  workload = _Workload(rng, 60, sampling=True)
  figures = Figures()
  submitted, done = {}, {}
  while workload.pending or engine.has_unfinished_requests():
    assert figures.steps < 5000, "no progress"
    for prompt, params in workload.arrivals():
      submitted[engine.add_request(prompt, params)] = (prompt, params)
      figures.requests += 1
    if workload.wants_invalid():
      with pytest.raises(ValueError):
        engine.add_request(_invalid_prompt(rng, cfg.vocab_size), SamplingParams(temperature=0.0))
      figures.rejected += 1
    victim = workload.victim([rid for rid in submitted if engine.scheduler.is_unfinished(rid)])
    if victim is not None:
      engine.abort_request(victim)
      figures.aborts += 1
    done.update({f.request_id: f for f in engine.step()})
    if outputs:
      _check_step(cfg, outputs.pop(), engine.scheduler, figures)
    figures.steps += 1
  figures.leaks = int(not kv_cache_checks.all_free(engine.manager))
  print(figures.line(f"{name} (engine, real model)"))
  assert figures.leaks == 0 and figures.preemptions > 0 and figures.aborts > 0
  assert sorted(done) == sorted(submitted)
  reasons = collections.Counter()
  for rid, (prompt, params) in submitted.items():
    got, alone = done[rid], _run_alone(engine, prompt, params)
    reasons[got.finish_reason] += 1
    if got.finish_reason == "abort":
      assert got.output_token_ids == alone.output_token_ids[: len(got.output_token_ids)], (SEED, rid)
      continue
    assert (got.output_token_ids, got.finish_reason) == (alone.output_token_ids, alone.finish_reason), (SEED, rid)
    if params.logprobs is not None:
      for a, b in zip(got.logprobs, alone.logprobs):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top], (SEED, rid)
        np.testing.assert_allclose([a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top], atol=1e-4)
  assert kv_cache_checks.all_free(engine.manager)
  assert reasons["length"] and reasons["abort"], reasons
