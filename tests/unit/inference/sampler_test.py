"""Tests of the sampler against straightforward float64 references."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.inference import SamplingParams
from maxtext.inference.sampler import Sampler, TokenHistory, filtered_probs, processed_logits, top_ids


def _reference_kept(logits, temperature, top_k, top_p):
  """{token: probability} after temperature, top-k and top-p, written as plainly as possible."""
  scaled = [x / temperature for x in logits]
  peak = max(scaled)
  weights = {i: math.exp(x - peak) for i, x in enumerate(scaled)}
  ranked = sorted(weights, key=lambda i: (-weights[i], i))
  if top_k != -1:
    ranked = ranked[:top_k]
  total = sum(weights[i] for i in ranked)
  probs = {i: weights[i] / total for i in ranked}
  kept, cumulative = [], 0.0
  for i in ranked:
    kept.append(i)
    cumulative += probs[i]
    if cumulative >= top_p:
      break
  total = sum(probs[i] for i in kept)
  return {i: probs[i] / total for i in kept}


def _reference_logprobs(logits):
  peak = max(logits)
  log_total = peak + math.log(sum(math.exp(x - peak) for x in logits))
  return [x - log_total for x in logits]


def test_greedy_takes_the_argmax_and_the_lowest_id_on_ties():
  logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 2.0, 5.0]])
  out = Sampler().sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=3)], [0, 4])
  np.testing.assert_array_equal(out.token_ids, [1, 3])
  assert out.logprobs == (None, None)


@pytest.mark.parametrize("top_k", [-1, 1, 3, 5])
@pytest.mark.parametrize("top_p", [0.2, 0.6, 0.9, 1.0])
def test_filtered_probs_match_the_reference(np_rng, top_k, top_p):
  logits = np_rng.normal(size=12) * 2.0
  ids, probs = filtered_probs(logits, SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p))
  expected = _reference_kept(logits.tolist(), 0.7, top_k, top_p)
  assert ids.tolist() == list(expected)
  np.testing.assert_allclose(probs, list(expected.values()), rtol=1e-12)


def test_sample_frequencies_follow_the_filtered_distribution():
  logits = np.array([2.0, 1.5, 1.0, 0.2, -1.0, 0.9])
  params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=11)
  num = 4000
  out = Sampler().sample(np.tile(logits, (num, 1)), [params] * num, list(range(num)))
  expected = _reference_kept(logits.tolist(), 0.8, 4, 0.9)
  frequencies = np.bincount(out.token_ids, minlength=6) / num
  for token in range(6):
    assert abs(frequencies[token] - expected.get(token, 0.0)) < 0.03, (token, frequencies, expected)
  assert set(out.token_ids.tolist()) == set(expected)


def test_top_k_one_is_greedy_at_any_temperature(np_rng):
  logits = np_rng.normal(size=(50, 9))
  out = Sampler().sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 50, [0] * 50)
  np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=1))


def test_seeded_requests_do_not_depend_on_the_batch(np_rng):
  row = np_rng.normal(size=16)
  seeded = SamplingParams(temperature=1.0, seed=42)
  other = SamplingParams(temperature=1.0)
  alone = [int(Sampler(0).sample(row[None], [seeded], [step]).token_ids[0]) for step in range(20)]
  mixed = []
  for step in range(20):
    logits = np.stack([np_rng.normal(size=16), row, np_rng.normal(size=16)])
    mixed.append(int(Sampler(step).sample(logits, [other, seeded, other], [3, step, 9]).token_ids[1]))
  assert alone == mixed
  assert len(set(alone)) > 1  # the step index changes the draw


def test_unseeded_requests_follow_the_sampler_seed(np_rng):
  logits = np_rng.normal(size=(30, 16))
  params = [SamplingParams(temperature=1.0)] * 30
  first = Sampler(5).sample(logits, params, [0] * 30).token_ids
  np.testing.assert_array_equal(first, Sampler(5).sample(logits, params, [0] * 30).token_ids)
  assert not np.array_equal(first, Sampler(6).sample(logits, params, [0] * 30).token_ids)


def test_logprobs_come_from_the_raw_logits(np_rng):
  logits = np_rng.normal(size=(2, 10)) * 3.0
  params = [SamplingParams(temperature=0.5, seed=1, logprobs=3), SamplingParams(temperature=0.0, logprobs=0)]
  out = Sampler().sample(jnp.asarray(logits, jnp.float32), params, [0, 0])
  rows = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
  for i, result in enumerate(out.logprobs):
    expected = _reference_logprobs(rows[i].tolist())
    assert result.token_id == out.token_ids[i]
    assert result.logprob == pytest.approx(expected[result.token_id], abs=1e-9)
    order = sorted(range(10), key=expected.__getitem__, reverse=True)
    assert [t for t, _ in result.top] == order[: len(result.top)]
    np.testing.assert_allclose([v for _, v in result.top], [expected[t] for t in order[: len(result.top)]], atol=1e-9)
  assert len(out.logprobs[0].top) == 3 and out.logprobs[1].top == ()


def test_errors():
  sampler = Sampler()
  with pytest.raises(ValueError, match=r"logits must have shape \[R, V\], got \(4,\)"):
    sampler.sample(np.zeros(4), [SamplingParams(temperature=0.0)], [0])
  with pytest.raises(ValueError, match="4 rows, 1 params, 4 step indices"):
    sampler.sample(np.zeros((4, 3)), [SamplingParams(temperature=0.0)], [0] * 4)
  with pytest.raises(ValueError, match="logits row 1 holds non-finite values"):
    sampler.sample(np.array([[0.0, 1.0], [np.nan, 0.0]]), [SamplingParams(temperature=0.0)] * 2, [0, 0])


def test_penalties_follow_vllms_definitions_on_hand_computed_logits():
  logits = np.array([[2.0, -1.0, 0.5, 3.0]])
  history = TokenHistory(prompt_token_ids=[1], output_token_ids=[3, 3, 2])
  params = SamplingParams(
      temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=1
  )
  # repetition (tokens 1, 2, 3 seen): -1 * 2, 0.5 / 2, 3 / 2; frequency (counts 0, 0, 1, 2) and presence on top.
  want = [2.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25]
  np.testing.assert_allclose(processed_logits(logits[0], params, history, ()), want)
  out = Sampler().sample(logits, [params], [3], [history])
  assert out.token_ids.tolist() == [0]  # 3 without the penalties
  assert out.logprobs[0].rank == 2  # ranked under the raw logits, where token 3 leads


def test_min_tokens_masks_eos_and_stop_tokens_unless_eos_is_ignored():
  logits = np.array([[5.0, 1.0, 4.0, 0.0]])
  history = TokenHistory([1], [3])  # one token generated
  masked = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
  assert Sampler(eos_token_id=0).sample(logits, [masked], [1], [history]).token_ids.tolist() == [1]
  ignored = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
  assert Sampler(eos_token_id=0).sample(logits, [ignored], [1], [history]).token_ids.tolist() == [0]
  done = TokenHistory([1], [3, 3])  # min_tokens reached: nothing is masked
  assert Sampler(eos_token_id=0).sample(logits, [masked], [2], [done]).token_ids.tolist() == [0]
  with pytest.raises(ValueError, match="need the request's token history"):
    Sampler().sample(logits, [masked], [1])


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  ids, kept = filtered_probs(np.log(probs), SamplingParams(temperature=1.0, min_p=0.2))
  assert ids.tolist() == [0, 1, 2]  # 0.05 < 0.2 * 0.5
  np.testing.assert_allclose(kept, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95])
  ids, _ = filtered_probs(np.log(probs), SamplingParams(temperature=1.0, min_p=0.2, top_k=2))
  assert ids.tolist() == [0, 1]


@pytest.mark.parametrize("k", [0, 1, 3, 7, 8, 20])
def test_top_ids_are_the_k_largest_with_ties_to_the_lower_id(np_rng, k):
  values = np.round(np_rng.normal(size=8), 1)  # rounding makes ties
  values[[2, 5]] = values.max()
  expected = sorted(range(8), key=lambda i: (-values[i], i))[:k]
  assert top_ids(values, k).tolist() == expected
