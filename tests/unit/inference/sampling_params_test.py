"""Tests of SamplingParams validation."""

import dataclasses

import pytest

from maxtext.inference import SamplingParams


def test_defaults_match_vllm_shape():
  params = SamplingParams()
  assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 0.0, -1, 1.0)
  assert (params.seed, params.logprobs, params.stop_token_ids) == (None, None, ())
  assert params.is_greedy and not SamplingParams(temperature=0.5).is_greedy


def test_stop_token_ids_become_a_tuple_and_params_are_frozen():
  params = SamplingParams(stop_token_ids=[5, 7], logprobs=0, seed=3, top_k=1, top_p=0.5)
  assert params.stop_token_ids == (5, 7)
  with pytest.raises(dataclasses.FrozenInstanceError):
    params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int, got float"),
        ({"max_tokens": True}, TypeError, "max_tokens must be an int, got bool"),
        ({"temperature": -0.1}, ValueError, r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
        ({"temperature": float("nan")}, ValueError, "temperature must be >= 0"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number, got str"),
        ({"top_k": 0}, ValueError, r"top_k must be -1 \(all tokens\) or >= 1, got 0"),
        ({"top_k": -2}, ValueError, "top_k must be -1"),
        ({"top_k": 1.5}, TypeError, "top_k must be an int"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": None}, TypeError, "top_p must be a number"),
        ({"seed": "1"}, TypeError, "seed must be None or an int"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"logprobs": -1}, ValueError, "logprobs must be None or >= 0, got -1"),
        ({"logprobs": 1.0}, TypeError, "logprobs must be None or an int"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a sequence of ints"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids must be a sequence of ints"),
        ({"stop_token_ids": [1, -3]}, ValueError, "stop_token_ids must hold token ids >= 0, got -3"),
    ],
)
def test_validation(kwargs, error, match):
  with pytest.raises(error, match="SamplingParams." + match):
    SamplingParams(**kwargs)
