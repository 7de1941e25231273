"""Tests of Request bookkeeping."""

import pytest

from maxtext.inference import SamplingParams
from maxtext.inference.request import Request, RequestStatus


def test_token_counts():
  request = Request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
  assert request.prompt_token_ids == (5, 6, 7)
  assert (request.num_prompt_tokens, request.num_tokens, request.num_remaining_tokens) == (3, 3, 3)
  assert request.status == RequestStatus.WAITING and not request.is_finished
  request.output_token_ids += [9, 10]
  request.num_computed_tokens = 4
  assert request.all_token_ids == (5, 6, 7, 9, 10)
  assert (request.num_tokens, request.num_remaining_tokens) == (5, 1)
  request.status = RequestStatus.FINISHED
  assert request.is_finished


def test_default_sampling_params_and_type_check():
  assert Request("r", [1]).sampling_params == SamplingParams()
  with pytest.raises(TypeError, match="request 'r': sampling_params must be a SamplingParams, got dict"):
    Request("r", [1], {"max_tokens": 3})
