"""Tests of overlapped greedy decode steps (`overlap_decode_steps`): the engine dispatches the next decode step
before the current one's tokens reach the host, and the program takes the fed-back tokens on the device.

The reference for every request is the same workload in an engine with `overlap_decode_steps=false`: the tokens,
finish reasons and the books (blocks, state slots) must be the same, whatever finishes or is aborted while a step
planned ahead is in flight.
"""

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.configs import load_config
from maxtext.inference import SamplingParams
from maxtext.inference import engine as engine_module
from maxtext.inference.batch import build_batch
from maxtext.inference.engine import LLMEngine
from maxtext.inference.scheduler import ScheduledRequest, SchedulerOutput

# One token bucket (16) and one request bucket (8): every step of a request has the same shapes with or without
# the overlap, hence the same rounding.
RUNNER = {
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "min_token_bucket": 16,
    "max_num_seqs": 4,
    "max_target_length": 40,
    "seed": 0,
}


def _engine(name, overlap, **overrides):
  return LLMEngine(load_config(model_name=name, overlap_decode_steps=overlap, **dict(RUNNER, **overrides)))


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 500, n).tolist() for n in lengths]


def _step(engine, done):
  for finished in engine.step():
    done[finished.request_id] = finished
  kv_cache_checks.check_consistency(engine.manager, {r.request_id for r in engine.scheduler.running})


def _run(engine, max_steps=400):
  """Steps until nothing is left; returns {request id: FinishedRequest}, checking the books after every step."""
  done = {}
  for _ in range(max_steps):
    if not engine.has_unfinished_requests():
      return done
    _step(engine, done)
  raise AssertionError("the engine did not finish")


def _outputs(done, ids):
  return [(done[rid].output_token_ids, done[rid].finish_reason) for rid in ids]


def _finish(engine):
  """The outputs of `_workload` run to the end."""
  ids = _workload(engine)
  return _outputs(_run(engine), ids)


def _workload(engine, stop_token=None):
  """Four greedy requests of different lengths; the third stops at `stop_token` (when given)."""
  prompts = _prompts(3, (9, 5, 12, 7))
  params = [
      SamplingParams(temperature=0.0, max_tokens=14),
      SamplingParams(temperature=0.0, max_tokens=3),
      SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[] if stop_token is None else [stop_token]),
      SamplingParams(temperature=0.0, max_tokens=9),
  ]
  return [engine.add_request(p, sp) for p, sp in zip(prompts, params)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny", "qwen3.5-tiny"])
def test_overlapped_steps_give_the_tokens_and_books_of_steps_one_after_the_other(name):
  off, on = _engine(name, False), _engine(name, True)
  # A stop token the third request samples mid-way, from a run without it: it finishes while a step planned
  # ahead for it is in flight.
  ids = _workload(off)
  stop_token = _run(off)[ids[2]].output_token_ids[4]
  ids_off, ids_on = _workload(off, stop_token), _workload(on, stop_token)
  expected, got = _outputs(_run(off), ids_off), _outputs(_run(on), ids_on)
  assert got == expected
  assert expected[2][1] == "stop" and len(expected[2][0]) < 14
  assert off.stats.overlapped_steps == 0 and on.stats.overlapped_steps > 0
  assert on.stats.generated_tokens == sum(len(tokens) for tokens, _ in expected)  # the dropped ones not counted
  assert kv_cache_checks.all_free(on.manager) and kv_cache_checks.all_free(off.manager)


def test_a_request_that_stops_alone_leaves_a_step_ahead_that_the_next_step_drops():
  off, on = _engine("llama-tiny", False), _engine("llama-tiny", True)
  prompt = _prompts(5, (6,))[0]
  reference = _run_one(off, prompt, SamplingParams(temperature=0.0, max_tokens=12))
  stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[reference[3]])
  tokens = _run_one(on, prompt, stop)
  assert tokens == _run_one(off, prompt, stop) and len(tokens) < 12
  assert on._ahead is not None  # pylint: disable=protected-access  # planned before the stop token was seen
  # The next call drops it and runs the new request from its own schedule.
  assert _run_one(on, prompt, SamplingParams(temperature=0.0, max_tokens=12)) == reference
  assert kv_cache_checks.all_free(on.manager)


def _run_one(engine, prompt, params):
  rid = engine.add_request(prompt, params)
  return _run(engine)[rid].output_token_ids


@pytest.mark.slow
def test_an_abort_while_a_step_ahead_is_in_flight_drops_only_that_request():
  off, on = _engine("qwen3.5-tiny", False), _engine("qwen3.5-tiny", True)
  expected = _finish(off)
  ids = _workload(on)
  done = {}
  while not on._ahead:  # pylint: disable=protected-access
    _step(on, done)
  victim = ids[0]
  generated = list(next(r for r in on.scheduler.running if r.request_id == victim).output_token_ids)
  on.abort_request(victim)
  done.update(_run(on))
  assert done[victim].finish_reason == "abort" and list(done[victim].output_token_ids) == generated
  assert expected[0][0][: len(generated)] == tuple(generated)
  assert _outputs(done, ids[1:]) == expected[1:]
  assert kv_cache_checks.all_free(on.manager)


@pytest.mark.slow
def test_a_request_added_while_a_step_ahead_is_in_flight_gets_its_solo_tokens():
  on = _engine("gemma3-tiny", True)
  late_prompt = _prompts(7, (10,))[0]
  alone = _run_one(on, late_prompt, SamplingParams(temperature=0.0, max_tokens=8))
  ids = _workload(on)
  done = {}
  while not on._ahead:  # pylint: disable=protected-access
    _step(on, done)
  late = on.add_request(late_prompt, SamplingParams(temperature=0.0, max_tokens=8))
  done.update(_run(on))
  assert done[late].output_token_ids == alone
  assert all(done[rid].finish_reason == "length" for rid in ids)
  assert kv_cache_checks.all_free(on.manager)


@pytest.mark.slow
def test_no_step_is_planned_ahead_while_requests_wait_or_for_prefix_caching_state_blocks():
  # max_num_seqs=1: the other requests wait, so every step is scheduled (one may be planned ahead only for the
  # last request).
  waiting = _engine("llama-tiny", True, max_num_seqs=1)
  ids = _workload(waiting)
  reference = _engine("llama-tiny", False, max_num_seqs=1)
  ids_reference = _workload(reference)
  assert _outputs(_run(waiting), ids) == _outputs(_run(reference), ids_reference)
  last_request_steps = 9 - 1  # the last request's decodes: all but its first token, sampled by the prefill
  assert 0 < waiting.stats.overlapped_steps <= last_request_steps
  # Prefix caching with Gated DeltaNet checkpoints state blocks at block boundaries: never planned ahead.
  blocks = _engine("qwen3.5-tiny", True, enable_prefix_caching=True, mamba_block_size=4)
  plain = _engine("qwen3.5-tiny", False, enable_prefix_caching=True, mamba_block_size=4)
  assert _finish(blocks) == _finish(plain)
  assert blocks.stats.overlapped_steps == 0


def test_prefix_caching_of_attention_blocks_overlaps_with_the_same_tokens():
  on = _engine("llama-tiny", True, enable_prefix_caching=True)
  off = _engine("llama-tiny", False, enable_prefix_caching=True)
  first_on, first_off = _finish(on), _finish(off)
  again_on, again_off = _finish(on), _finish(off)
  assert first_on == first_off and again_on == again_off == first_off
  assert on.stats.prefix_cache_hits == off.stats.prefix_cache_hits > 0
  assert on.stats.overlapped_steps > 0


def test_a_failed_finite_check_drops_the_step_planned_ahead(monkeypatch):
  on = _engine("llama-tiny", True)
  ids = _workload(on)
  done = {}
  while not on._ahead:  # pylint: disable=protected-access
    _step(on, done)

  def broken(finite):
    raise ValueError("logits row 0 holds non-finite values (NaN or inf); the model output is broken")

  monkeypatch.setattr(engine_module, "check_finite_rows", broken)
  with pytest.raises(ValueError, match="non-finite"):
    on.step()
  assert on._ahead is None  # pylint: disable=protected-access
  for rid in ids:
    if on.scheduler.is_unfinished(rid):
      on.abort_request(rid)
  on.step()
  assert kv_cache_checks.all_free(on.manager)


def test_a_batch_planned_ahead_leaves_the_fed_back_tokens_to_the_program():
  engine = _engine("llama-tiny", False)
  ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in _prompts(9, (3, 4))]
  done = {}
  _step(engine, done)  # both prefills, each sampling its first token: both decode next
  out = engine.scheduler.schedule()  # the decodes, allocated: plan the step after them
  entries = out.scheduled
  assert [e.request.request_id for e in entries] == ids and all(n == 1 for _, n in entries)
  computed = {rid: c + 1 for rid, c in out.num_computed_tokens.items()}
  for e in entries:
    assert engine.manager.allocate_slots(e.request.request_id, computed[e.request.request_id], 1)
  plan = SchedulerOutput(entries, computed, tuple(computed), (), ())
  batch = build_batch(engine.cfg, plan, engine.manager, one_step_ahead=True)
  assert not batch.input_ids.any()
  assert list(batch.positions[: len(entries)]) == list(computed.values())
  stale = SchedulerOutput(entries, {rid: c - 1 for rid, c in computed.items()}, tuple(computed), (), ())
  with pytest.raises(ValueError, match=r"a plan one step ahead computes 1 token at 1 past the request's computed"):
    build_batch(engine.cfg, stale, engine.manager, one_step_ahead=True)
  two = SchedulerOutput((ScheduledRequest(entries[0].request, 2),), computed, (), (), ())
  with pytest.raises(ValueError, match=r"got 2 tokens at"):
    build_batch(engine.cfg, two, engine.manager, one_step_ahead=True)
