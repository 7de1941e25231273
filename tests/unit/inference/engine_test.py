"""Tests of `LLMEngine` under faults: aborts mid-prefill / mid-decode / while waiting, cache exhaustion, requests
that fail validation, and an interrupted `LLM.generate`. The reference for every request is the same request run
alone in the same engine (nothing else queued), so only the runner's sharing of caches between requests is tested.
"""

import logging
import threading
import types

import numpy as np
import pytest
from flax import nnx

from support import kv_cache_checks
from maxtext.checkpoint import save_params
from maxtext.configs import load_config
from maxtext.inference import LLM, SamplingParams
from maxtext.inference import engine_programs
from maxtext.inference.engine import LLMEngine, check_finite_rows
from maxtext.inference.engine_programs import sampling_logits_indices
from maxtext.kernels.cpu import cpu_attention, cpu_gemm, huge_pages
from maxtext.kernels.cpu.backend import PANELS
from maxtext.configs.errors import ConfigError
from maxtext.layers import linears
from maxtext.models import Transformer

# Tiny shapes: one token bucket (16) and one request bucket (8), so each engine compiles its step once (and a
# request's solo run and its batched run use the same matmul shapes, hence the same rounding).
RUNNER = {
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "min_token_bucket": 16,
    "max_num_seqs": 4,
    "max_target_length": 48,
    "seed": 0,
}


def _engine(name, **overrides):
  return LLMEngine(load_config(model_name=name, **dict(RUNNER, **overrides)))


def _run(engine, max_steps=500):
  """Steps until nothing is left; returns {request id: FinishedRequest} and checks the books after every step."""
  done = {}
  for _ in range(max_steps):
    if not engine.has_unfinished_requests():
      return done
    for finished in engine.step():
      done[finished.request_id] = finished
    kv_cache_checks.check_consistency(engine.manager, {r.request_id for r in engine.scheduler.running})
  raise AssertionError("the engine did not finish")


def _alone(engine, prompt, params):
  rid = engine.add_request(prompt, params)
  return _run(engine)[rid].output_token_ids


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 512, n).tolist() for n in lengths]


@pytest.fixture(name="hybrid", scope="module")
def fixture_hybrid():
  """A Qwen3.5 engine (GDN state slots + a full-attention group) with a pool small enough to preempt."""
  return _engine("qwen3.5-tiny", num_kv_blocks=16)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_at_once_and_leaves_the_others_unchanged(hybrid, when):
  prompts = _prompts(1, (30, 9, 12))
  params = SamplingParams(temperature=0.0, max_tokens=6)
  expected = [_alone(hybrid, p, params) for p in prompts]
  victim_prompt = _prompts(2, (26,))[0]  # 26 tokens: two prefill chunks of the 16-token budget
  victim = hybrid.add_request(victim_prompt, SamplingParams(temperature=0.0, max_tokens=20))  # first: it starts at step 1
  ids = [hybrid.add_request(p, params) for p in prompts]
  steps = {"waiting": 0, "mid_prefill": 1, "mid_decode": 5}[when]
  done = {}
  for _ in range(steps):
    done.update({f.request_id: f for f in hybrid.step()})
  request = next(r for r in hybrid.scheduler.running + hybrid.scheduler.waiting if r.request_id == victim)
  if when == "mid_prefill":
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens
  if when == "mid_decode":
    assert request.output_token_ids and hybrid.manager.has_request(victim)
  held = hybrid.manager.has_request(victim)
  free_before = hybrid.manager.num_free_blocks(), hybrid.manager.num_free_state_slots()
  hybrid.abort_request(victim)
  assert not hybrid.manager.has_request(victim)
  if held:  # its blocks and state slot are back in the pools now, not at the next step
    assert hybrid.manager.num_free_blocks() > free_before[0]
    assert hybrid.manager.num_free_state_slots() == free_before[1] + 1
  kv_cache_checks.check_consistency(hybrid.manager, {r.request_id for r in hybrid.scheduler.running})
  done.update(_run(hybrid))
  assert done[victim].finish_reason == "abort"
  assert done[victim].output_token_ids == tuple(request.output_token_ids)
  assert [done[rid].output_token_ids for rid in ids] == expected
  assert kv_cache_checks.all_free(hybrid.manager)


def test_abort_of_an_unknown_or_finished_request_is_a_value_error(hybrid):
  rid = hybrid.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))
  _run(hybrid)
  for bad in (rid, "never-added"):
    with pytest.raises(ValueError, match=rf"request '{bad}': no unfinished request has this id"):
      hybrid.abort_request(bad)
  assert kv_cache_checks.all_free(hybrid.manager)


def test_a_request_failing_validation_does_not_disturb_running_ones(hybrid):
  prompts = _prompts(3, (20, 7))
  params = SamplingParams(temperature=0.0, max_tokens=5)
  expected = [_alone(hybrid, p, params) for p in prompts]
  ids = [hybrid.add_request(p, params) for p in prompts]
  done = {f.request_id: f for f in hybrid.step()}
  for bad, match in (([], "the prompt is empty"), ([5, 512], "prompt token 512"), (list(range(3, 60)), "shorter")):
    with pytest.raises(ValueError, match=match):
      hybrid.add_request(bad, params)
  with pytest.raises(ValueError, match="already exists"):
    hybrid.add_request([9], params, request_id=ids[1])
  done.update(_run(hybrid))
  assert [done[rid].output_token_ids for rid in ids] == expected
  assert kv_cache_checks.all_free(hybrid.manager)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "kvshare-tiny"])
def test_cache_exhaustion_preempts_and_every_request_matches_its_solo_run(name):
  # 13 usable blocks of 4 tokens per attention group (kvshare-tiny has four); each request needs up to 10 in each.
  engine = _engine(name, num_kv_blocks={"qwen3.5-tiny": 14, "kvshare-tiny": 53}[name])
  prompts = _prompts(4, (22, 17, 25, 12, 19, 28))
  params = [
      SamplingParams(temperature=0.0, max_tokens=12),
      SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7),
  ] * 3
  expected = [_alone(engine, p, sp) for p, sp in zip(prompts, params)]
  ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
  preemptions = engine.stats.preemptions
  done = _run(engine)
  assert engine.stats.preemptions > preemptions, "the pool must be small enough to force preemption"
  assert [done[rid].output_token_ids for rid in ids] == expected
  assert kv_cache_checks.all_free(engine.manager)


@pytest.mark.slow
def test_a_preempted_request_resumes_from_the_prefix_cache_with_the_tokens_of_its_solo_run():
  # scheduler_test's hand-computed case through the engine: 6 usable blocks of 4 tokens, b preempted in step 6
  # with 12 tokens computed. Under prefix caching it resumes from its 8 cached tokens and computes 4 of them again,
  # without from 0 (all 12 again); its tokens are those of its run alone in a pool that never preempts.
  prompts = _prompts(9, (8, 8))
  params = [SamplingParams(temperature=0.0, max_tokens=9), SamplingParams(temperature=0.0, max_tokens=10)]
  roomy = _engine("llama-tiny", num_kv_blocks=64)
  expected = [_alone(roomy, p, sp) for p, sp in zip(prompts, params)]
  for prefix_caching, resumed_at, recomputed in ((True, 8, 4), (False, 0, 12)):
    engine = _engine("llama-tiny", num_kv_blocks=7, enable_prefix_caching=prefix_caching)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(9):
      done.update({f.request_id: f for f in engine.step()})
    assert engine.stats.preemptions == 1 and list(done) == [ids[0]]
    done.update({f.request_id: f for f in engine.step()})
    assert [r.num_computed_tokens for r in engine.scheduler.running] == [13]  # b's resume step ran
    assert engine.stats.prefix_cache_hits == resumed_at
    done.update(_run(engine))
    assert engine.stats.recomputed_tokens == engine.stats.as_dict()["recomputed_tokens"] == recomputed
    assert [done[rid].output_token_ids for rid in ids] == expected
    assert kv_cache_checks.all_free(engine.manager)


@pytest.mark.slow
def test_llm_abort_request_and_an_interrupted_generate_leave_nothing_behind(monkeypatch):
  llm = LLM(model_name="qwen3.5-tiny", **dict(RUNNER, num_kv_blocks=16))
  rid = llm.engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=30))
  llm.engine.step()
  llm.abort_request(rid)
  assert kv_cache_checks.all_free(llm.engine.manager)
  calls = []
  real_step = llm.engine.step

  def step_then_interrupt():
    calls.append(1)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real_step()

  monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
  with pytest.raises(KeyboardInterrupt):
    llm.generate([[5, 6, 7], [8, 9] * 10], SamplingParams(temperature=0.0, max_tokens=8))
  assert not llm.engine.scheduler.has_unfinished_requests() and kv_cache_checks.all_free(llm.engine.manager)
  monkeypatch.undo()
  (out,) = llm.generate(
      [[11, 12]], SamplingParams(temperature=0.0, max_tokens=3)
  )  # the next call runs only its own request
  assert len(out.outputs[0].token_ids) == 3 and llm.engine.stats.aborted_requests == 3


def test_a_set_cancel_event_stops_generate_before_its_next_step():
  llm = LLM(model_name="llama-tiny", **RUNNER)
  cancel = threading.Event()
  seen = []

  def on_token(index, token):
    seen.append((index, token))
    cancel.set()  # as a Ctrl-C handler would, after the first sampled token

  with pytest.raises(KeyboardInterrupt, match="generate cancelled"):
    llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=8), on_token=on_token, cancel=cancel)
  assert len(seen) == 2  # one step ran (both prompts prefilled and sampled once), the next did not
  assert not llm.engine.scheduler.has_unfinished_requests() and kv_cache_checks.all_free(llm.engine.manager)
  assert llm.engine.stats.aborted_requests == 2
  (out,) = llm.generate([[11, 12]], SamplingParams(temperature=0.0, max_tokens=3), cancel=threading.Event())
  assert len(out.outputs[0].token_ids) == 3


def test_logits_rows_are_the_sampling_requests_padded_to_a_power_of_two():
  batch = types.SimpleNamespace(request_ids=("a", "b", "c"), logits_indices=np.array([0, 4, 9, 0, 0, 0, 0, 0]))
  np.testing.assert_array_equal(sampling_logits_indices(batch, ["c"]), [9])
  np.testing.assert_array_equal(sampling_logits_indices(batch, ["a", "c", "b"]), [0, 9, 4, 0])


def test_logits_rows_padded_to_a_given_count_and_never_below_the_sampling_requests():
  batch = types.SimpleNamespace(request_ids=("a", "b", "c"), logits_indices=np.array([0, 4, 9, 0, 0, 0, 0, 0]))
  np.testing.assert_array_equal(sampling_logits_indices(batch, ["c", "a"], num_rows=8), [9, 0, 9, 9, 9, 9, 9, 9])
  with pytest.raises(ValueError, match="num_rows=2 cannot hold the logits rows of 3 sampling requests"):
    sampling_logits_indices(batch, ["a", "b", "c"], num_rows=2)


def test_greedy_and_sampled_steps_produce_the_same_greedy_tokens():
  """The fused greedy program and the separate step + logits path agree (temperature 0 through the sampler)."""
  prompts = [[5, 6, 7, 8], [9, 10]]
  fused = LLM(model_name="llama-tiny", **RUNNER).generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
  # Logprobs send greedy requests through the separate path: logits to the host, the sampler's argmax.
  separate = LLM(model_name="llama-tiny", **RUNNER).generate(
      prompts, SamplingParams(temperature=0.0, max_tokens=5, logprobs=1)
  )
  assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in separate]


def test_greedy_on_device_rejects_non_finite_rows_like_the_sampler():
  check_finite_rows(np.array([True, True]))
  with pytest.raises(ValueError, match="logits row 1 holds non-finite values"):
    check_finite_rows(np.array([True, False, False]))


def test_state_slot_zeroing_compiles_once_when_the_engine_starts():
  """Reusing recurrent state slots (a second generate) runs the program compiled at start-up: no compile per reuse."""
  llm = LLM(model_name="qwen3.5-tiny", **RUNNER)
  zero_rows = llm.engine.programs.zero_rows
  assert zero_rows._cache_size() == 1  # pylint: disable=protected-access
  first = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=3))
  again = llm.generate(
      [[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=3)
  )  # the freed slots are zeroed and reused
  assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
  assert zero_rows._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{}, {"ici_tensor_parallelism": 2}])
def test_the_cpu_backend_is_the_default_on_one_cpu_device_and_keeps_the_tokens(monkeypatch, mesh):
  """With no backend named, one CPU device runs `cpu` (not a mesh of several: `reference`): decode steps of 1-8
  requests take the kernel and keep the reference's tokens; more rows only for weights in column panels; the
  attention of every step program takes the attention kernel there."""
  traced, attended = [], []
  real = cpu_gemm.matmul
  monkeypatch.setattr(cpu_gemm, "matmul", lambda x, w: traced.append((x.shape, w.ndim)) or real(x, w))
  real_attend = cpu_attention.attend
  monkeypatch.setattr(cpu_attention, "attend", lambda q, *a, **k: attended.append(q.shape) or real_attend(q, *a, **k))
  prompts = _prompts(5, [5, 9, 3])
  params = SamplingParams(max_tokens=6, temperature=0.0)
  tokens = {}
  for on in (True, False):
    traced.clear()
    attended.clear()
    engine = _engine("llama-tiny", kernel_backend="" if on else "reference", min_token_bucket=1, **mesh)
    assert engine.backend.name == ("cpu" if on and not mesh else "reference")
    expected = on and not mesh and cpu_gemm.unsupported_reason() is None
    small_steps = []
    # Which programs the steps run: record the token counts of those compiled with the backend's options.
    program = engine.programs.program

    def recording(name, num_tokens, program=program, engine=engine, small_steps=small_steps):  # pylint: disable=dangerous-default-value  # binds this round's list
      if engine.backend.compiler_options(num_tokens):
        small_steps.append((num_tokens,))
      return program(name, num_tokens)

    engine.programs.program = recording
    ids = engine.add_requests([(p, params) for p in prompts])
    done = _run(engine)
    tokens[on] = [done[i].output_token_ids for i in ids]
    assert bool(traced) is expected
    assert all(1 <= rows <= 8 or w_ndim == 3 for (rows, _), w_ndim in traced)
    assert not expected or max(rows for (rows, _), w_ndim in traced if w_ndim == 3) > 8  # a prefill on panels
    assert bool(attended) is expected
    assert not expected or max(num_tokens for num_tokens, _, _ in attended) > 8  # the prefill programs' too
    # Steps of 1-8 tokens ran as the program compiled with the kernel's options (and only with the kernel on), the
    # one-token decodes among them; prefills of more tokens did not.
    assert bool(small_steps) is expected
    assert not expected or ((1,) in small_steps and all(shape[0] <= 8 for shape in small_steps))
  assert tokens[True] == tokens[False]


def test_kernel_backend_cpu_refuses_a_mesh_of_several_devices_and_the_retired_key_says_why():
  with pytest.raises(ConfigError, match=r"kernel_backend=cpu runs on one CPU device .* the mesh has 2 devices"):
    _engine("llama-tiny", kernel_backend="cpu", ici_tensor_parallelism=2)
  with pytest.raises(ConfigError, match=r"'cpu_small_matmul' .* was removed: the CPU kernels are the kernel backend"):
    _engine("llama-tiny", cpu_small_matmul=False)


def _checkpointed_engine(tmp_path, name, **overrides):
  """An engine over an Orbax checkpoint of the model (a loaded model, unlike the tiny configs' dummy weights)."""
  path = save_params(tmp_path / "ckpt", Transformer(load_config(model_name=name), rngs=nnx.Rngs(1)))
  return _engine(name, load_parameters_path=path, **overrides)


@pytest.mark.slow
def test_background_compile_serves_the_first_one_token_greedy_step(tmp_path):
  """A loaded model's one-request greedy decode step compiles while the weights load; decoding then traces no more."""
  prompt, params = _prompts(2, [6])[0], SamplingParams(max_tokens=5, temperature=0.0)
  tokens = {}
  for on in (True, False):
    engine = _checkpointed_engine(tmp_path / str(on), "qwen3-next-tiny", min_token_bucket=1, background_compile=on)
    if on:
      engine.programs.background_compile.join()
      assert engine.stats.step_traces == 1  # the one-token step, traced in the thread
    else:
      assert engine.programs.background_compile is None and engine.stats.step_traces == 0
    tokens[on] = _alone(engine, prompt, params)
    assert engine.stats.step_traces == 2  # the prompt's 8-token bucket, and the one-token bucket once
  assert tokens[True] == tokens[False] and len(tokens[True]) == 5


@pytest.mark.slow
def test_a_failed_background_compile_only_logs(tmp_path, monkeypatch, caplog):
  def broken(*args):
    raise ValueError("no batch today")

  monkeypatch.setattr(engine_programs, "build_batch", broken)
  with caplog.at_level(logging.WARNING, logger=engine_programs.__name__):
    engine = _checkpointed_engine(tmp_path, "llama-tiny", min_token_bucket=1)
    engine.programs.background_compile.join()
  monkeypatch.undo()
  assert "compiling the decode step in the background failed (it compiles when first used): no batch today" in caplog.text
  assert len(_alone(engine, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))) == 3
  assert engine.stats.step_traces == 2


def test_dummy_weights_start_no_background_compile():
  assert _engine("llama-tiny").programs.background_compile is None


@pytest.mark.slow
def test_huge_page_weights_moves_the_weights_in_a_thread_and_keeps_the_tokens():
  """The move starts after the first step (not while the first programs compile) and keeps the tokens."""
  prompt, params = _prompts(2, [6])[0], SamplingParams(max_tokens=4, temperature=0.0)
  tokens = {}
  for on in (True, False):
    engine = _engine("qwen3-next-tiny", huge_page_weights=on, kernel_backend="cpu")
    assert engine.weights.placing is None and engine.placed_bytes is None
    tokens[on] = _alone(engine, prompt, params)
    if on:
      engine.weights.placing.join()
      weight_bytes = sum(size for _, size in huge_pages.buffer_ranges(engine.weights.leaves))
      if huge_pages.unsupported_reason() is None:
        assert 0 < engine.placed_bytes <= weight_bytes
      else:
        assert engine.placed_bytes == 0
    else:
      assert engine.weights.placing is None and engine.placed_bytes is None
  assert tokens[True] == tokens[False] and len(tokens[True]) == 4


@pytest.mark.slow
def test_huge_page_weights_failure_only_logs(monkeypatch, caplog):
  def broken(ranges):
    raise OSError(f"no madvise for {len(ranges)} ranges")

  monkeypatch.setattr(huge_pages, "collapse", broken)
  with caplog.at_level(logging.WARNING, logger="maxtext.inference.engine"):
    engine = _engine("qwen3-next-tiny", huge_page_weights=True, kernel_backend="cpu")
    _alone(engine, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    engine.weights.placing.join()
  assert engine.placed_bytes == 0
  assert "kernel_backend=cpu: placing the weights failed (they stay where they are): no madvise for" in caplog.text


def _dense_layers(engine):
  return [layer for _, layer in nnx.iter_modules(engine.model) if isinstance(layer, linears.DenseGeneral)]


@pytest.mark.slow
def test_cpu_weight_panels_put_loaded_kernels_in_panels_and_keep_the_tokens(tmp_path):
  """A loaded model (its structure in panels known before the weights load, for the background compile) and the
  same model row-major: the same tokens, the one-token step compiled once."""
  prompt, params = _prompts(3, [7])[0], SamplingParams(max_tokens=5, temperature=0.0)
  tokens = {}
  for on in (True, False):
    engine = _checkpointed_engine(tmp_path / str(on), "qwen3-next-tiny", min_token_bucket=1, cpu_weight_panels=on)
    expected = on and cpu_gemm.unsupported_reason() is None
    in_panels = [layer for layer in _dense_layers(engine) if layer.layout == PANELS]
    assert bool(in_panels) is expected
    assert engine.prepared_bytes == sum(layer.kernel.get_value().nbytes for layer in in_panels)
    engine.programs.background_compile.join()
    tokens[on] = _alone(engine, prompt, params)
    assert engine.stats.step_traces == 2  # the prompt's bucket, and the one-token step compiled in the thread
  assert tokens[True] == tokens[False] and len(tokens[True]) == 5


def test_cpu_weight_panels_with_dummy_weights_and_on_xla_only():
  on = _engine("llama-tiny", cpu_weight_panels=True)
  assert (on.prepared_bytes > 0) is (cpu_gemm.unsupported_reason() is None)
  off = _engine("llama-tiny", cpu_weight_panels=True, kernel_backend="reference")
  assert off.prepared_bytes == 0 and not any(layer.layout for layer in _dense_layers(off))
  prompt, params = _prompts(4, [5])[0], SamplingParams(max_tokens=4, temperature=0.0)
  assert _alone(on, prompt, params) == _alone(off, prompt, params)
