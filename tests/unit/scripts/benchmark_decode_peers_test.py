"""scripts/benchmark_decode_peers.py's pure helpers (its workers run in tests/unit/scripts/benchmark_decode_test.py)."""

import importlib.util
import types
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_decode_peers.py"


def _load_peers():
  spec = importlib.util.spec_from_file_location("benchmark_decode_peers", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
    "variant, overrides, peer",
    [
        ("float32", (), "maxtext"),
        ("bfloat16", ("weight_dtype=bfloat16",), "maxtext:bfloat16"),
        ("int8w", ("weight_dtype=bfloat16", "quantization=int8w"), "maxtext:int8w"),
        ("compact", ("weight_dtype=bfloat16", "greedy_head_candidates=64"), "maxtext:compact"),
        ("dtype=bfloat16", ("dtype=bfloat16",), "maxtext:dtype=bfloat16"),
    ],
)
def test_a_variant_is_a_named_override_or_a_key_value(variant, overrides, peer):
  peers = _load_peers()
  assert peers.variant_overrides(variant) == overrides and peers.variant_peer(variant) == peer


@pytest.mark.parametrize("variant", ["float16", "=bfloat16", ""])
def test_a_variant_that_is_neither_is_refused_with_the_names(variant):
  with pytest.raises(ValueError, match=r"one of \['bfloat16', 'compact', 'float32', 'int8w'\] or key=value, got"):
    _load_peers().variant_overrides(variant)


def test_random_prompts_are_seeded_and_inside_the_vocabulary():
  peers = _load_peers()
  prompts = peers.random_prompts(40, 3, 5, seed=1)
  assert prompts == peers.random_prompts(40, 3, 5, seed=1) != peers.random_prompts(40, 3, 5, seed=2)
  assert len(prompts) == 3 and all(len(p) == 5 and all(3 <= t < 40 for t in p) for p in prompts)


@pytest.mark.parametrize(
    "model, model_name, prompt, use_chat_template",
    [
        ("smollm2", "smollm2-135m-instruct", "What is the capital of France?", True),
        ("gemma3-270m", "gemma3-270m", "The capital of France is", False),  # a base model: raw text after BOS
    ],
)
def test_each_gguf_model_is_one_entry_with_its_readme_prompt_and_the_long_ones(
    model, model_name, prompt, use_chat_template
):
  peers = _load_peers()
  spec = peers.GGUF_MODELS[model]
  assert (spec.model_name, spec.prompt, spec.use_chat_template) == (model_name, prompt, use_chat_template)
  assert spec.agreement_prompts[0] == prompt and spec.agreement_prompts[1:] == peers.example_prompts.LONG_PROMPTS


@pytest.mark.parametrize("model, calls", [("smollm2", [{}]), ("gemma3-270m", [{"model": "gemma3-270m"}])])
def test_fetch_gguf_asks_the_fetch_script_for_the_models_file(monkeypatch, model, calls):
  """SmolLM2 is fetch()'s default file; another model is fetch(model=...)."""
  peers = _load_peers()
  seen = []

  def fetch(**kwargs):
    seen.append(kwargs)
    return "/cache/file.gguf"

  monkeypatch.setattr(peers, "_load_sibling", lambda name: types.SimpleNamespace(fetch=fetch))
  assert peers.fetch_gguf(model) == "/cache/file.gguf" and seen == calls


def test_gguf_model_passes_the_prompt_ids_to_every_worker(monkeypatch):
  peers = _load_peers()
  monkeypatch.setattr(peers, "fetch_gguf", lambda model: f"/cache/{model}.gguf")
  ids = {"prompt_ids": [2, 5], "agreement_prompt_ids": [[2, 5], [2, 7, 8]]}
  calls = []

  def run_worker(python, role, args, timeout):
    del python  # this interpreter
    calls.append((role, list(args), timeout))
    return ids

  checkpoint, hf_config, args = peers.gguf_model("gemma3-270m", run_worker, 9.0)
  assert calls == [("prompt", ["--model", "gemma3-270m", "--gguf", "/cache/gemma3-270m.gguf"], 9.0)]
  assert checkpoint == ids and hf_config == {}
  assert args == ["--model", "gemma3-270m", "--gguf", "/cache/gemma3-270m.gguf", "--prompt-ids", "2", "5"] + [
      "--agreement-ids",
      "[[2, 5], [2, 7, 8]]",
  ]
  assert peers.prompt_note("gemma3-270m", checkpoint) == (
      "'The capital of France is' after BOS, no chat template: 2 prompt ids; agreement prompts 2, 3 ids"
  )
  with pytest.raises(SystemExit, match="the smollm2 prompt ids failed: boom"):
    peers.gguf_model("smollm2", lambda *args: {"error": "boom"}, 1.0)


@pytest.mark.parametrize(
    "tokens, reference, count",
    [([1, 2, 3], [1, 2, 3], 3), ([1, 2, 4, 3], [1, 2, 3, 3], 2), ([9], [1], 0), ([], [1], 0)],
)
def test_leading_agreement_counts_equal_tokens_up_to_the_first_difference(tokens, reference, count):
  assert _load_peers().leading_agreement(tokens, reference) == count


def test_agreement_rows_count_each_peer_against_float32_and_sum_them():
  peers = _load_peers()
  results = {
      "maxtext": {"agreement_tokens": [[1, 2, 3], [4, 5, 6]]},
      "maxtext:bfloat16": {"agreement_tokens": [[1, 2, 3], [4, 9, 6]]},
      "maxtext:int8w": {"error": "exit status 1"},
      "llamacpp": {"agreement_tokens": [[7, 2, 3], [4, 5, 6]]},
  }
  rows = peers.agreement_rows("gemma3-270m", results)
  assert [(r["peer"], r["counts"], r["sum"]) for r in rows] == [("maxtext:bfloat16", [3, 1], 4), ("llamacpp", [0, 3], 3)]
  assert [(r["max_dlogprob"], r["mean_dlogprob"]) for r in rows] == [(None, None)] * 2  # no logprobs given
  lines = peers.format_agreement(rows, 3).splitlines()
  assert lines[0].split()[:4] == ["model", "peer", "leading", "tokens"]
  assert lines[2].split() == ["gemma3-270m", "maxtext:bfloat16", "[3,", "1]", "4", "/", "6", "-", "-"]


def test_agreement_rows_compare_log_probabilities_over_the_agreed_tokens_only():
  peers = _load_peers()
  results = {
      "maxtext": {
          "agreement_tokens": [[1, 2, 3], [4, 5, 6]],
          "agreement_logprobs": [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]],
      },
      # Agrees on 3 then 1 tokens: the diffs read are 0.5, 0.0, 0.25 and 0.125; the 9.0 after the split is not.
      "maxtext:int8w": {
          "agreement_tokens": [[1, 2, 3], [4, 9, 6]],
          "agreement_logprobs": [[-1.5, -2.0, -3.25], [-1.125, -9.0, -1.0]],
      },
      "llamacpp": {"agreement_tokens": [[1, 2, 3], [4, 5, 6]]},
  }
  int8w, llamacpp = peers.agreement_rows("smollm2", results)
  assert int8w["max_dlogprob"] == 0.5 and int8w["mean_dlogprob"] == (0.5 + 0.0 + 0.25 + 0.125) / 4
  assert llamacpp["max_dlogprob"] is None
  line = peers.format_agreement([int8w, llamacpp], 3).splitlines()[2]
  assert line.split()[-2:] == ["0.5000", "0.2188"]
  assert peers.agreement_rows("gemma3-270m", {"maxtext": {"error": "x"}, "llamacpp": results["llamacpp"]}) == []
