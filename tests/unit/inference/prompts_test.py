"""Tests of the prompt checks shared by the API and the CLI, and of `LLM.generate` applying them."""

import numpy as np
import pytest

from support import kv_cache_checks
from maxtext.inference import LLM, SamplingParams
from maxtext.inference import prompts


@pytest.mark.parametrize(
    "given, expected",
    [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        ((np.int64(5),), [(np.int64(5),)]),
        (["a", [1]], ["a", [1]]),
        ({"prompt": "a"}, [{"prompt": "a"}]),
        ([], []),
    ],
)
def test_normalize_prompts(given, expected):
  assert prompts.normalize_prompts(given) == expected


@pytest.mark.parametrize(
    "given, match",
    [
        (b"abc", r"got bytes \(decode bytes to str first, or pass list\(\.\.\.\) for token ids\)"),
        (bytearray(b"a"), r"got bytearray"),
        (None, r"got NoneType None"),
        (123, r"got int 123"),
        (1.5, r"got float 1.5"),
        ({1, 2}, r"got set"),
    ],
)
def test_normalize_prompts_rejects_other_types(given, match):
  with pytest.raises(
      TypeError, match=r"prompts must be a string, a list of token ids, a dict prompt, or a list of those; " + match
  ):
    prompts.normalize_prompts(given)


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        ("", ValueError, r"^p is empty; a prompt needs at least one character \(or give token ids\)$"),
        ([], ValueError, r"^p is empty; a prompt needs at least one token$"),
        ("ok\udc80", ValueError, r"^p is not valid UTF-8 text: byte 0x80 at character 2"),
        ("\udfff", ValueError, r"^p is not valid UTF-8 text: lone surrogate U\+DFFF at character 0"),
        ([1, True], TypeError, r"^p\[1\] must be an int token id, got bool True$"),
        ([1, 2.0], TypeError, r"^p\[1\] must be an int token id, got float 2.0$"),
        (b"x", TypeError, r"^p must be a string or a list of token ids, got bytes$"),
        (None, TypeError, r"^p must be a string or a list of token ids, got NoneType$"),
    ],
)
def test_check_prompt_rejections(prompt, error, match):
  with pytest.raises(error, match=match):
    prompts.check_prompt(prompt, "p")


@pytest.mark.parametrize("prompt", ["é ✓ 漢字", [0], (np.int32(3), 4)])
def test_check_prompt_accepts(prompt):
  prompts.check_prompt(prompt, "p")


@pytest.mark.parametrize(
    "num_prompt, max_tokens, limit, expected", [(4, 10, 32, 10), (4, 100, 32, 28), (31, 5, 32, 1), (40, 5, 32, 0)]
)
def test_num_generatable_tokens(num_prompt, max_tokens, limit, expected):
  assert prompts.num_generatable_tokens(num_prompt, max_tokens, limit) == expected


@pytest.fixture(name="llm", scope="module")
def fixture_llm():
  return LLM(max_target_length=32, num_kv_blocks=16, block_size=4, max_num_seqs=4)


@pytest.mark.parametrize(
    "given, error, match",
    [
        ("", ValueError, r"prompts\[0\] is empty; a prompt needs at least one character"),
        (["ok", ""], ValueError, r"prompts\[1\] is empty"),
        ("bad\udcff", ValueError, r"prompts\[0\] is not valid UTF-8 text: byte 0xff at character 3"),
        (
            123,
            TypeError,
            r"prompts must be a string, a list of token ids, a dict prompt, or a list of those; got int 123",
        ),
        (None, TypeError, r"prompts must be .*; got NoneType None"),
        (b"abc", TypeError, r"prompts must be .*; got bytes"),
    ],
)
def test_generate_rejects_bad_prompts_and_queues_nothing(llm, given, error, match):
  with pytest.raises(error, match=match):
    llm.generate(given, SamplingParams(temperature=0.0, max_tokens=1))
  assert not llm.engine.has_unfinished_requests() and kv_cache_checks.all_free(llm.engine.manager)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"max_tokens": 2}, r"sampling_params must be a SamplingParams or a list of them, got dict"),
        ([SamplingParams(temperature=0.0), "greedy"], r"sampling_params\[1\] must be a SamplingParams, got str"),
    ],
)
def test_generate_rejects_bad_sampling_params(llm, params, match):
  with pytest.raises(TypeError, match=match):
    llm.generate([[5, 6], [7, 8]], params)


def test_max_tokens_beyond_max_target_length_stops_there_with_reason_length(llm):
  # This prompt's greedy continuation never samples eos (token 2) within the 28 tokens left by max_target_length.
  (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=10**8))
  completion = out.outputs[0]
  assert (len(completion.token_ids), completion.finish_reason) == (28, "length")
  assert kv_cache_checks.all_free(llm.engine.manager)


def test_numpy_token_ids_are_accepted_as_python_ints(llm):
  (a,) = llm.generate([np.array([5, 6, 7]).tolist()], SamplingParams(temperature=0.0, max_tokens=2))
  (b,) = llm.generate([[np.int64(5), np.int32(6), np.uint8(7)]], SamplingParams(temperature=0.0, max_tokens=2))
  assert a.outputs[0].token_ids == b.outputs[0].token_ids
  assert all(isinstance(t, int) for t in b.prompt_token_ids)
