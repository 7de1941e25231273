"""Tests of the offline `LLM` API from the outside: prompts in, tokens out, checked against the dense forward.

The reference is the model's own full-sequence forward (`Transformer.__call__`) run greedily over a padded
buffer, with float64 log-softmax rows for logprobs: none of the runner's machinery (scheduler, paged caches,
batching, sampler) is involved in it.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import kv_cache_checks, param_checks
from maxtext.inference import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from maxtext.inference import llm as llm_module

EOS = 2  # the byte-level tokenizer's eos id
BYTE_OFFSET = 3  # byte b is token b + 3 (0, 1, 2 are pad, bos, eos)
PAD_TO = 32
# The base config's tiny Llama (2 layers, vocab 512); small pools keep allocation cheap.
OVERRIDES = {"max_target_length": 32, "num_kv_blocks": 32, "block_size": 4, "max_num_seqs": 4, "seed": 5}


def _dense_greedy(model, prompt, max_tokens):
  """(greedy tokens, float64 log-softmax row of every step) by repeated full-sequence forwards, stopping at eos.

  The sequence is padded to PAD_TO after its last token; the forward is causal, so padding cannot change the
  logits at the last real position.
  """
  forward = jax.jit(lambda tokens: model(tokens[None])[0])
  tokens, out, rows = list(prompt), [], []
  for _ in range(max_tokens):
    padded = jnp.asarray(tokens + [0] * (PAD_TO - len(tokens)), jnp.int32)
    logits = np.asarray(forward(padded)[len(tokens) - 1], np.float64)
    shifted = logits - logits.max()
    rows.append(shifted - np.log(np.exp(shifted).sum()))
    token = int(np.argmax(logits))
    out.append(token)
    tokens.append(token)
    if token == EOS:
      break
  return out, rows


def _byte_ids(text, bos=True):
  return ([1] if bos else []) + [b + BYTE_OFFSET for b in text.encode("utf-8")]


def _tokens(outputs):
  return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(name="llm", scope="module")
def fixture_llm():
  """One engine shared by the tests that do not read its counters."""
  return LLM(**OVERRIDES)


@pytest.fixture(name="greedy", scope="module")
def fixture_greedy(llm):
  """`greedy(prompt_ids, max_tokens) -> (tokens, logprob rows)` over the shared engine's model, cached."""
  cache = {}

  def greedy(prompt, max_tokens):
    key = (tuple(prompt), max_tokens)
    if key not in cache:
      cache[key] = _dense_greedy(param_checks.canonical_model(llm.engine), prompt, max_tokens)
    return cache[key]

  return greedy


def test_a_string_prompt_is_byte_encoded_with_bos_and_decoded_greedily(llm, greedy):
  outputs = llm.generate("hi!", SamplingParams(temperature=0.0, max_tokens=5))
  assert len(outputs) == 1 and isinstance(outputs[0], RequestOutput)
  out = outputs[0]
  assert out.prompt == "hi!"
  assert list(out.prompt_token_ids) == _byte_ids("hi!")
  completion = out.outputs[0]
  assert isinstance(completion, CompletionOutput) and completion.index == 0
  expected, _ = greedy(_byte_ids("hi!"), 5)
  assert list(completion.token_ids) == expected
  byte_values = bytes(t - BYTE_OFFSET for t in expected if BYTE_OFFSET <= t < 256 + BYTE_OFFSET)
  assert completion.text == byte_values.decode("utf-8", errors="replace")
  assert completion.logprobs is None
  assert completion.finish_reason == ("stop" if expected[-1] == EOS else "length")
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_token_id_prompts_single_or_listed_give_the_same_tokens(llm, greedy):
  prompt = [17, 300, 45, 99, 7]
  single = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))
  listed = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
  as_tuple = llm.generate([tuple(prompt)], SamplingParams(temperature=0.0, max_tokens=4))
  expected, _ = greedy(prompt, 4)
  assert _tokens(single) == _tokens(listed) == _tokens(as_tuple) == [expected]
  assert single[0].prompt is None and list(single[0].prompt_token_ids) == prompt


def test_a_batch_keeps_prompt_order_and_matches_each_prompt_alone(llm, greedy):
  prompts = ["abc", [400, 401, 402, 403, 404, 405, 406], "a longer prompt!", [9]]
  outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
  assert [o.prompt for o in outputs] == ["abc", None, "a longer prompt!", None]
  ids = [_byte_ids("abc"), prompts[1], _byte_ids("a longer prompt!"), [9]]
  assert [list(o.prompt_token_ids) for o in outputs] == ids
  assert _tokens(outputs) == [greedy(p, 4)[0] for p in ids]
  assert len({o.request_id for o in outputs}) == 4
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_one_sampling_params_per_prompt(llm, greedy):
  prompts = [[5, 6, 7], [8, 9]]
  outputs = llm.generate(
      prompts, [SamplingParams(temperature=0.0, max_tokens=2), SamplingParams(temperature=0.0, max_tokens=5)]
  )
  assert _tokens(outputs) == [greedy(prompts[0], 2)[0], greedy(prompts[1], 5)[0]]


def test_generate_iter_yields_each_output_as_soon_as_it_and_the_earlier_ones_are_finished(llm, greedy):
  short, long, middle = [5, 6, 7], [8, 9], [10, 11, 12]
  params = [
      SamplingParams(temperature=0.0, max_tokens=2),
      SamplingParams(temperature=0.0, max_tokens=12),
      SamplingParams(temperature=0.0, max_tokens=3),
  ]
  expected = [greedy(short, 2)[0], greedy(long, 12)[0], greedy(middle, 3)[0]]
  assert len(expected[0]) < len(expected[2]) < len(expected[1])  # the seeded model meets no eos this early
  outputs = llm.generate_iter([short, long, middle], params)
  first = next(outputs)
  assert _tokens([first]) == expected[:1]
  assert llm.engine.has_unfinished_requests()  # the others are still decoding
  # The third finishes before the second, but comes after it: prompt order.
  assert _tokens(list(outputs)) == expected[1:]
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_closing_generate_iter_early_aborts_the_unfinished_requests(llm, greedy):
  outputs = llm.generate_iter(
      [[5, 6, 7], [8, 9]], [SamplingParams(temperature=0.0, max_tokens=2), SamplingParams(temperature=0.0, max_tokens=12)]
  )
  assert _tokens([next(outputs)]) == [greedy([5, 6, 7], 2)[0]]
  outputs.close()
  assert not llm.engine.scheduler.has_unfinished_requests() and kv_cache_checks.all_free(llm.engine.manager)
  # The engine serves the next call as if nothing had happened (its first step reports the abort).
  assert _tokens(llm.generate([8, 9], SamplingParams(temperature=0.0, max_tokens=3))) == [greedy([8, 9], 3)[0]]
  assert not llm.engine.has_unfinished_requests()


def test_generate_iter_checks_the_prompts_before_returning(llm):
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    llm.generate_iter([[5], []])
  assert not llm.engine.has_unfinished_requests()


def test_the_default_sampling_params_are_vllms_16_tokens_at_temperature_one(llm, greedy):
  outputs = llm.generate([3, 4, 5])
  assert len(_tokens(outputs)[0]) == 16
  assert _tokens(outputs) != [greedy([3, 4, 5], 16)[0]]  # sampled from the whole distribution, not the argmax
  seeded = [llm.generate([3, 4, 5], SamplingParams(seed=7))[0].outputs[0].token_ids for _ in range(2)]
  assert seeded[0] == seeded[1] and len(seeded[0]) == 16


def test_sampling_params_count_must_match_the_prompts(llm):
  with pytest.raises(ValueError, match=r"got 3 SamplingParams for 2 prompts; give one or one each"):
    llm.generate([[1, 2], [3, 4]], [SamplingParams(temperature=0.0)] * 3)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([1.5], r"prompts\[0\] must be a string or a list of token ids, got float"),
        ([[1, 2], [3, "4"]], r"prompts\[1\]\[1\] must be an int token id, got str '4'"),
        ([[True, False]], r"prompts\[0\]\[0\] must be an int token id, got bool True"),
        ([None], r"prompts\[0\] must be a string or a list of token ids, got NoneType"),
    ],
)
def test_a_prompt_that_is_neither_text_nor_token_ids_is_a_type_error(llm, prompts, match):
  with pytest.raises(TypeError, match=match):
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
  assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[]], r"prompts\[0\] is empty; a prompt needs at least one token"),
        ([[1, 2, 512]], r"prompt token 512 must be an int in \[0, vocab_size=512\)"),
        ([list(range(3, 40))], r"the prompt has 37 tokens but must be shorter than max_target_length=32"),
    ],
)
def test_a_prompt_the_scheduler_rejects_is_a_value_error(llm, prompts, match):
  with pytest.raises(ValueError, match=match):
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))


def test_an_empty_list_of_prompts_gives_no_outputs(llm):
  assert llm.generate([], SamplingParams(temperature=0.0, max_tokens=1)) == []


def test_a_rejected_prompt_queues_none_of_the_batch(llm, greedy):
  with pytest.raises(ValueError, match=r"the prompt has 37 tokens"):
    llm.generate([[10, 11, 12], list(range(3, 40))], SamplingParams(temperature=0.0, max_tokens=2))
  with pytest.raises(TypeError, match=r"prompts\[1\] must be a string or a list of token ids"):
    llm.generate([[10, 11, 12], 3.0], SamplingParams(temperature=0.0, max_tokens=2))
  assert not llm.engine.has_unfinished_requests()
  # The next call returns exactly its own request and does not run leftovers of the failed ones.
  generated_before = llm.engine.stats.generated_tokens
  outputs = llm.generate([[20, 21]], SamplingParams(temperature=0.0, max_tokens=2))
  assert _tokens(outputs) == [greedy([20, 21], 2)[0]]
  assert llm.engine.stats.generated_tokens - generated_before == 2
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_logprobs_follow_the_dense_forward_and_are_absent_unless_asked(llm, greedy):
  prompt = [50, 60, 70, 80]
  with_lp, without = llm.generate(
      [prompt, prompt],
      [SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), SamplingParams(temperature=0.0, max_tokens=4)],
  )
  expected, rows = greedy(prompt, 4)
  assert without.outputs[0].logprobs is None
  assert list(with_lp.outputs[0].token_ids) == list(without.outputs[0].token_ids) == expected
  logprobs = with_lp.outputs[0].logprobs
  assert len(logprobs) == len(expected)
  for position, token, row in zip(logprobs, expected, rows):
    best = np.argsort(-row, kind="stable")[:3]
    assert token == best[0]  # greedy: the sampled token is the most likely one, so the dict holds the 3 best
    assert list(position) == best.tolist()
    for rank, t in enumerate(best, start=1):
      assert isinstance(position[t], Logprob) and position[t].rank == rank
      np.testing.assert_allclose(position[t].logprob, row[t], atol=1e-4)
      assert position[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
  np.testing.assert_allclose(with_lp.outputs[0].cumulative_logprob, sum(r[t] for r, t in zip(rows, expected)), atol=1e-4)
  assert without.outputs[0].cumulative_logprob is None


def test_logprobs_zero_gives_only_the_sampled_token(llm, greedy):
  out = llm.generate([[30, 31]], SamplingParams(temperature=0.0, max_tokens=2, logprobs=0))[0].outputs[0]
  _, rows = greedy([30, 31], 2)
  assert [list(position) for position in out.logprobs] == [[t] for t in out.token_ids]
  got = [position[t].logprob for position, t in zip(out.logprobs, out.token_ids)]
  np.testing.assert_allclose(got, [r[t] for r, t in zip(rows, out.token_ids)], atol=1e-4)


def _dense_rows(model, tokens):
  """float64 log-softmax rows of the dense forward at every position of `tokens` (padded to PAD_TO)."""
  padded = jnp.asarray(list(tokens) + [0] * (PAD_TO - len(tokens)), jnp.int32)
  logits = np.asarray(jax.jit(lambda t: model(t[None])[0])(padded)[: len(tokens)], np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_prompt_logprobs_follow_the_dense_forward_over_chunks_and_skip_the_prefix_cache():
  # Prefill chunks of 8 tokens split the 21-token prompt three ways; the prefix cache holds the prompt after the
  # first request, which a request asking for prompt logprobs must not use (it needs every position's logits).
  llm = LLM(**OVERRIDES | {"max_num_batched_tokens": 8, "enable_prefix_caching": True})
  prompt = [1] + list(range(40, 60))
  plain = SamplingParams(temperature=0.0, max_tokens=2)
  asking = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
  first = llm.generate([prompt], asking)[0]
  cached, again = llm.generate([prompt, prompt], [plain, asking])
  rows = _dense_rows(param_checks.canonical_model(llm.engine), prompt)
  assert cached.num_cached_tokens > 0 and again.num_cached_tokens == 0 and cached.prompt_logprobs is None
  for out in (first, again):
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
      position, row, token = out.prompt_logprobs[t], rows[t - 1], prompt[t]
      best = np.argsort(-row, kind="stable")[:3]
      assert list(position)[0] == token and set(position) == {token, *best.tolist()}
      np.testing.assert_allclose(position[token].logprob, row[token], atol=1e-4)
      assert position[token].rank == 1 + int(np.sum(row > row[token] + 1e-9))
      for rank, t_best in enumerate(best, start=1):
        np.testing.assert_allclose(position[t_best].logprob, row[t_best], atol=1e-4)
        if t_best != token:
          assert position[t_best].rank == rank
      assert position[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
  assert [o.outputs[0].token_ids for o in (first, cached, again)] == [first.outputs[0].token_ids] * 3


def test_prompt_logprobs_zero_gives_the_prompt_token_alone(llm):
  out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
  assert out.prompt_logprobs[0] is None and [list(p) for p in out.prompt_logprobs[1:]] == [[6], [7]]


def test_finish_reasons_stop_token_max_tokens_and_max_target_length(llm, greedy):
  prompt = [100, 101, 102]
  expected, _ = greedy(prompt, 6)
  assert EOS not in expected  # otherwise this check would not exercise what it claims
  stop_at = expected[2]
  first = expected.index(stop_at)
  stopped, capped, at_limit = llm.generate(
      [prompt, prompt, list(range(3, 3 + 29))],
      [
          SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at]),
          SamplingParams(temperature=0.0, max_tokens=3),
          SamplingParams(temperature=0.0, max_tokens=10),
      ],
  )
  assert list(stopped.outputs[0].token_ids) == expected[: first + 1]  # the stop token is kept
  assert stopped.outputs[0].finish_reason == "stop"
  assert list(capped.outputs[0].token_ids) == expected[:3] and capped.outputs[0].finish_reason == "length"
  # 29 prompt tokens + 3 generated reach max_target_length=32 before max_tokens=10.
  assert len(at_limit.outputs[0].token_ids) == 3 and at_limit.outputs[0].finish_reason == "length"
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_the_progress_bar_goes_to_stderr(llm, capsys):
  llm.generate([[40, 41]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=True)
  captured = capsys.readouterr()
  assert captured.out == ""
  assert "generating" in captured.err


def _last_bar(err: str) -> str:
  """The progress bar as last drawn (tqdm redraws it in place with carriage returns)."""
  return [part for part in err.replace("\n", "\r").split("\r") if part.startswith("generating")][-1]


def test_the_progress_bar_ends_at_100_percent_when_requests_stop_early(llm, capsys):
  prompt = [100, 101, 102]
  (free,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))
  stop_at = free.outputs[0].token_ids[2]
  outputs = llm.generate(
      [prompt, [40, 41]],
      [
          SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_at]),
          SamplingParams(temperature=0.0, max_tokens=4),
      ],
      use_tqdm=True,
  )
  generated = sum(len(out.outputs[0].token_ids) for out in outputs)
  assert outputs[0].outputs[0].finish_reason == "stop" and generated <= 3 + 4  # far below the 20 + 4 reachable
  drawn = _last_bar(capsys.readouterr().err)
  assert drawn.startswith("generating: 100%") and f" {generated}/{generated} " in drawn, drawn


def _bars(err: str) -> list[str]:
  return [part for part in err.replace("\n", "\r").split("\r") if part.startswith("generating")]


@pytest.mark.parametrize("max_tokens", [None, 32, 10**8])  # no bound of its own, or none below max_target_length
def test_a_call_without_a_token_bound_counts_requests_from_its_first_drawing(llm, capsys, max_tokens):
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  outputs = llm.generate([[100, 101, 102], [40, 41], [7] * 20], params, use_tqdm=True)
  generated = sum(len(out.outputs[0].token_ids) for out in outputs)
  bars = _bars(capsys.readouterr().err)
  # max_target_length=32 leaves 29 + 30 + 12 = 71 reachable tokens; a bar of tokens would promise those.
  assert bars[0].startswith("generating:   0%") and " 0/3 " in bars[0], bars[0]
  assert bars[-1].startswith("generating: 100%") and " 3/3 " in bars[-1] and f"{generated} tok" in bars[-1], bars[-1]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_across_engines_and_batches():
  prompt = [200, 201, 202, 203]
  seeded = SamplingParams(max_tokens=8, temperature=1.5, seed=7)
  alone = LLM(**OVERRIDES).generate([prompt], seeded)
  other = LLM(**OVERRIDES)
  batch = other.generate(
      [[5, 6, 7, 8, 9, 10], prompt, prompt, [11]],
      [
          SamplingParams(max_tokens=3, temperature=1.0),
          seeded,
          SamplingParams(max_tokens=8, temperature=1.5, seed=8),
          seeded,
      ],
  )
  assert _tokens(alone)[0] == _tokens(batch)[1]
  assert _tokens(batch)[1] != _tokens(batch)[2]  # another seed draws other tokens
  assert _tokens(batch)[1] != _tokens(batch)[3]  # the same seed on another prompt too
  greedy_tokens = _tokens(other.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8)))[0]
  assert _tokens(alone)[0] != greedy_tokens  # temperature 1.5 really samples
  assert kv_cache_checks.all_free(other.engine.manager)


def test_engine_stats_count_steps_tokens_and_compile_once_per_bucket():
  llm = LLM(**OVERRIDES, min_token_bucket=16)  # the runner's smallest bucket: decodes share the 16-token one
  stats = llm.engine.stats
  llm.generate(
      [[3] * 5, [4] * 7], [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=0.0, max_tokens=2)]
  )
  # Step 1 prefills both prompts (12 tokens), then one decode step per further token of the longer request.
  assert (stats.steps, stats.prompt_tokens, stats.generated_tokens) == (4, 12, 6)
  assert stats.scheduled_tokens == 12 + 2 + 1 + 1
  assert stats.preemptions == 0 and stats.wall_time_s > 0
  assert stats.step_traces == 1
  # More requests and other lengths in the same 16-token bucket: no new trace.
  llm.generate([[5] * 9, [6], [7] * 3], SamplingParams(temperature=0.0, max_tokens=3))
  assert stats.step_traces == 1
  assert (stats.steps, stats.generated_tokens) == (7, 15)
  # A 20-token prefill needs the 32-token bucket: exactly one more trace, and its decodes reuse the first one.
  compiling, steady_tokens, compile_s = stats.compiling_steps, stats.steady_generated_tokens, stats.compile_time_s
  llm.generate([[8] * 20], SamplingParams(temperature=0.0, max_tokens=3))
  assert stats.step_traces == 2
  # Its prefill step compiled (and sampled the first token); the two decode steps are steady.
  assert (stats.compiling_steps, stats.steady_generated_tokens) == (compiling + 1, steady_tokens + 2)
  assert stats.compile_time_s > compile_s
  as_dict = stats.as_dict()
  assert as_dict["steps"] == 10 and as_dict["generated_tokens"] == 18
  assert stats.steady_wall_time_s > 0
  assert stats.steady_wall_time_s + stats.compile_time_s == pytest.approx(stats.wall_time_s)
  assert as_dict["generated_tokens_per_s"] == pytest.approx(stats.steady_generated_tokens / stats.steady_wall_time_s)
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_more_tensor_parallel_devices_than_jax_has_is_an_error():
  devices = len(jax.devices())
  with pytest.raises(ValueError, match=rf"ici_tensor_parallelism={2 * devices} needs {2 * devices} devices, but JAX"):
    LLM(ici_tensor_parallelism=2 * devices)


def _ascii_stop(expected):
  """A position k >= 1 of `expected` whose byte is printable ASCII not seen before it, and that character."""
  for k in range(1, len(expected)):
    byte = expected[k] - BYTE_OFFSET
    earlier = [t - BYTE_OFFSET for t in expected[:k]]
    if 32 <= byte < 127 and byte not in earlier:
      return k, chr(byte)
  return None


def test_a_stop_string_cuts_the_text_keeps_the_tokens_and_is_the_stop_reason(llm, greedy):
  for start in range(40, 120, 7):
    prompt = [start, start + 1]
    expected, _ = greedy(prompt, 12)
    found = _ascii_stop(expected)
    if found is not None and all(3 <= t < 259 for t in expected):
      break
  else:
    pytest.skip("no prompt gives a printable stop byte")
  k, stop = found
  plain, kept = llm.generate(
      [prompt, prompt],
      [
          SamplingParams(temperature=0.0, max_tokens=12, stop=[stop, "\x00never"]),
          SamplingParams(temperature=0.0, max_tokens=12, stop=stop, include_stop_str_in_output=True),
      ],
  )
  before = bytes(t - BYTE_OFFSET for t in expected[:k]).decode("utf-8", errors="replace")
  for out, text in ((plain, before), (kept, before + stop)):
    completion = out.outputs[0]
    assert completion.token_ids == expected[: k + 1]  # the token that completed the stop string is kept
    assert completion.text == text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_n_sequences_of_a_seeded_request_are_seed_plus_index(llm):
  params = SamplingParams(n=3, seed=11, max_tokens=5, temperature=0.8)
  out = llm.generate([[20, 21, 22]], params)[0]
  assert [c.index for c in out.outputs] == [0, 1, 2]
  for i, completion in enumerate(out.outputs):
    alone = llm.generate([[20, 21, 22]], SamplingParams(seed=11 + i, max_tokens=5, temperature=0.8))[0]
    assert completion.token_ids == alone.outputs[0].token_ids
  assert out.metrics.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs)
  assert out.finished and out.prompt_logprobs is None


def test_dict_prompts_and_token_lists_are_vllms_forms(llm, greedy):
  params = SamplingParams(temperature=0.0, max_tokens=3)
  by_dict = llm.generate([{"prompt_token_ids": [7, 8, 9]}, {"prompt": "ab"}], params)
  assert by_dict[0].outputs[0].token_ids == greedy([7, 8, 9], 3)[0]
  assert by_dict[1].prompt == "ab" and by_dict[1].prompt_token_ids == _byte_ids("ab")
  assert llm.generate({"prompt_token_ids": [7, 8, 9]}, params)[0].outputs[0].token_ids == greedy([7, 8, 9], 3)[0]
  with pytest.raises(TypeError, match=r'prompts\[0\] must be \{"prompt": text\} or \{"prompt_token_ids": ids\}'):
    llm.generate([{"text": "x"}], params)
  with pytest.raises(NotImplementedError, match=r"prompts\[0\]: multi_modal_data \(multimodal inputs\) is not"):
    llm.generate([{"prompt": "x", "multi_modal_data": {}}], params)
  with pytest.raises(NotImplementedError, match=r"LLM.generate: lora_request \(LoRA adapters\) is not supported"):
    llm.generate("x", params, lora_request=object())
  with pytest.raises(TypeError, match="unexpected keyword argument 'beam_width'"):
    llm.generate("x", params, beam_width=2)


def test_max_tokens_none_runs_to_max_target_length(llm):
  out = llm.generate([list(range(3, 23))], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
  assert len(out.outputs[0].token_ids) == OVERRIDES["max_target_length"] - 20
  assert out.outputs[0].finish_reason == "length"


def test_penalties_change_the_greedy_pick_as_vllm_defines_them(llm, greedy):
  prompt = [60, 61, 62]
  expected, rows = greedy(prompt, 2)
  # A presence penalty of 2 lowers the first token's logit by 2 at the second step, once it is in the output.
  out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, presence_penalty=2.0))[0]
  second = rows[1].copy()  # log-softmax differs from the logits by a constant per row: the argmax is the same
  second[expected[0]] -= 2.0
  assert out.outputs[0].token_ids == [expected[0], int(np.argmax(second))]


def test_llm_takes_vllms_model_argument(tmp_path):
  assert llm_module.model_keys("qwen3-tiny") == {"model_name": "qwen3-tiny"}
  assert llm_module.model_keys(str(tmp_path)) == {"hf_model_path": str(tmp_path)}
  assert llm_module.model_keys("m.gguf") == {"gguf_model_path": "m.gguf"}
  with pytest.raises(ValueError, match="LLM\\(model=...\\) is empty"):
    llm_module.model_keys("")
  with pytest.raises(NotImplementedError, match=r"LLM: enable_lora \(LoRA adapters\) is not supported"):
    LLM("qwen3-tiny", enable_lora=True)
  small = LLM(model="qwen3-tiny", max_model_len=24, max_num_seqs=2, num_kv_blocks=16, block_size=4)
  assert (small.cfg.model_name, small.cfg.max_target_length) == ("qwen3-tiny", 24)
  assert small.get_tokenizer() is small.tokenizer


def test_default_sampling_params_read_the_folders_generation_config(tmp_path):
  assert llm_module.default_sampling_params("") == SamplingParams()
  assert llm_module.default_sampling_params(str(tmp_path)) == SamplingParams()  # no generation_config.json
  config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}
  (tmp_path / "generation_config.json").write_text(json.dumps(config))
  params = llm_module.default_sampling_params(str(tmp_path))
  assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 7)
  assert (params.min_p, params.repetition_penalty, params.n) == (0.0, 1.0, 1)  # SamplingParams' defaults otherwise
  (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 3.0}))
  with pytest.raises(ValueError, match=r"generation_config.json: its sampling fields \{'temperature': 3.0\} are not"):
    llm_module.default_sampling_params(str(tmp_path))
  (tmp_path / "generation_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="generation_config.json: cannot be read as JSON"):
    llm_module.default_sampling_params(str(tmp_path))
  (tmp_path / "generation_config.json").write_text("[1]")
  with pytest.raises(ValueError, match="generation_config.json: must hold a JSON object, got list"):
    llm_module.default_sampling_params(str(tmp_path))


def test_generate_without_sampling_params_uses_the_models_defaults(llm):
  assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model has no folder
  before = llm.default_sampling_params
  llm.default_sampling_params = SamplingParams(temperature=0.0, max_tokens=3)
  try:
    assert len(llm.generate([[40, 41]], use_tqdm=False)[0].outputs[0].token_ids) == 3
  finally:
    llm.default_sampling_params = before
