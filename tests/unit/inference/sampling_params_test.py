"""Tests of SamplingParams: vLLM 0.32's defaults and bounds, and the fields this engine refuses."""

import dataclasses

import pytest

from maxtext.inference import SamplingParams


def test_defaults_are_vllms():
  params = SamplingParams()
  assert (params.n, params.max_tokens, params.min_tokens, params.temperature) == (1, 16, 0, 1.0)
  assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
  assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
  assert (params.seed, params.logprobs, params.stop, params.stop_token_ids) == (None, None, (), ())
  assert (params.ignore_eos, params.detokenize, params.skip_special_tokens) == (False, True, True)
  assert not params.include_stop_str_in_output
  assert not params.is_greedy and not params.plain_argmax and not params.has_penalties


def test_greedy_below_vllms_threshold_resets_the_filters():
  params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
  assert params.is_greedy and params.plain_argmax
  assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
  assert SamplingParams(temperature=9e-6).is_greedy and not SamplingParams(temperature=2e-5).is_greedy
  assert not SamplingParams(temperature=0.0, logprobs=0).plain_argmax
  assert not SamplingParams(temperature=0.0, repetition_penalty=1.1).plain_argmax
  assert not SamplingParams(temperature=0.0, prompt_logprobs=0).plain_argmax
  assert SamplingParams(temperature=0.0, min_tokens=2).has_penalties


def test_stop_and_stop_token_ids_become_tuples_and_params_are_frozen():
  params = SamplingParams(stop_token_ids=[5, 7], stop="###", logprobs=0, seed=3, top_k=1, top_p=0.5)
  assert params.stop_token_ids == (5, 7) and params.stop == ("###",)
  assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
  assert SamplingParams(max_tokens=None).max_tokens is None
  with pytest.raises(dataclasses.FrozenInstanceError):
    params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"n": 2, "temperature": 0.0}, ValueError, "n must be 1 when using greedy sampling, got 2"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be None or >= 1, got 0"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be None or an int, got float"),
        ({"max_tokens": True}, TypeError, "max_tokens must be None or an int, got bool"),
        ({"min_tokens": -1}, ValueError, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, ValueError, "min_tokens must be <= max_tokens=4, got 5"),
        ({"temperature": -0.1}, ValueError, r"temperature must be in \[0, 2\], got -0.1"),
        ({"temperature": 2.5}, ValueError, r"temperature must be in \[0, 2\], got 2.5"),
        ({"temperature": float("nan")}, ValueError, r"temperature must be in \[0, 2\]"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number, got str"),
        ({"top_k": -2}, ValueError, "top_k must be >= -1, got -2"),
        ({"top_k": 1.5}, TypeError, "top_k must be an int"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": None}, TypeError, "top_p must be a number"),
        ({"min_p": 1.5}, ValueError, r"min_p must be in \[0, 1\], got 1.5"),
        ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, ValueError, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"repetition_penalty": 0.0}, ValueError, r"repetition_penalty must be in \(0, inf\], got 0.0"),
        ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty must be finite, got inf"),
        ({"seed": "1"}, TypeError, "seed must be None or an int"),
        ({"seed": -1}, ValueError, "seed must be None or >= 0, got -1"),
        ({"logprobs": -1}, ValueError, "logprobs must be None or >= 0, got -1"),
        ({"logprobs": 1.0}, TypeError, "logprobs must be None or an int"),
        ({"stop": 3}, TypeError, "stop must be None, a string or a list of strings, got 3"),
        ({"stop": ["a", ""]}, ValueError, r"stop must hold non-empty strings, got \['a', ''\]"),
        ({"stop": "x", "detokenize": False}, ValueError, "stop strings need detokenize=True"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be None or a sequence of ints"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids must be None or a sequence of ints"),
        ({"stop_token_ids": [1, -3]}, ValueError, "stop_token_ids must hold token ids >= 0, got -3"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos must be True or False, got 1"),
        ({"prompt_logprobs": -1}, ValueError, "prompt_logprobs must be None or >= 0, got -1"),
        ({"prompt_logprobs": True}, TypeError, "prompt_logprobs must be None or an int"),
        ({"structured_outputs": {"json": {}}}, ValueError, r"structured_outputs \(guided decoding\) is not supported"),
        ({"logit_bias": {1: 2.0}}, ValueError, r"logit_bias \(logit bias\) is not supported"),
    ],
)
def test_validation(kwargs, error, match):
  with pytest.raises(error, match="SamplingParams." + match):
    SamplingParams(**kwargs)
