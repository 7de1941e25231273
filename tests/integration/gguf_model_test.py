"""The README's example model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading the same file.

transformers dequantizes the GGUF with its own code (`from_pretrained(folder, gguf_file=name)`) and runs its own
Llama in float32; this package reads the file with `gguf` and runs through the reference runner. Greedy tokens of
chat prompts must be equal, prompt logits within 1e-3, and the runner's layouts, chunked prefill and batching must
not change a token. The model is fetched once per machine (tests/conftest.py, `example_gguf`).
"""

import os

import numpy as np
import pytest

from support import kv_cache_checks, param_checks
from maxtext.inference import LLM, SamplingParams

pytestmark = [pytest.mark.hf, pytest.mark.slow]

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Translate 'good morning' into Spanish.",
)
MAX_TOKENS = 12
RUN = {"model_name": "smollm2-135m-instruct", "use_chat_template": True, "max_target_length": 256}


@pytest.fixture(name="hf_model", scope="module")
def fixture_hf_model(example_gguf):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(example_gguf)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return torch, model.eval(), tokenizer


@pytest.fixture(name="llm", scope="module")
def fixture_llm(example_gguf):
  return LLM(gguf_model_path=example_gguf, **RUN)


def _hf_chat_ids(tokenizer, prompt):
  ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _hf_greedy(hf_model, ids, max_tokens):
  torch, model, tokenizer = hf_model
  with torch.no_grad():
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
  return out[0, len(ids) :].tolist()


@pytest.fixture(name="hf_tokens", scope="module")
def fixture_hf_tokens(hf_model):
  tokenizer = hf_model[2]
  prompt_ids = [_hf_chat_ids(tokenizer, p) for p in PROMPTS]
  return prompt_ids, [_hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


@pytest.fixture(name="batch_outputs", scope="module")
def fixture_batch_outputs(llm):
  """All prompts in one batch through the default runner (hybrid layout, whole prefills)."""
  return llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def test_chat_prompts_match_transformers_token_for_token_in_one_batch(batch_outputs, hf_tokens):
  prompt_ids, expected = hf_tokens
  assert [list(o.prompt_token_ids) for o in batch_outputs] == prompt_ids  # the template renders as transformers'
  assert [list(o.outputs[0].token_ids) for o in batch_outputs] == expected


def test_the_capital_of_france_is_paris(batch_outputs):
  out = batch_outputs[0].outputs[0]
  assert "Paris" in out.text
  assert out.finish_reason == "stop"  # the template's end of turn (<|im_end|>) is the eos


def test_prompt_logits_match_transformers_within_1e3(llm, hf_model):
  torch, model, tokenizer = hf_model
  ids = _hf_chat_ids(tokenizer, PROMPTS[2])
  with torch.no_grad():
    expected = model(torch.tensor([ids])).logits[0].numpy()
  dense = param_checks.canonical_model(llm.engine)  # the runner's own Transformer, called full-sequence
  ours = np.asarray(dense(np.asarray([ids], np.int32))[0])
  assert ours.shape == expected.shape == (len(ids), 49152)
  np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "runner",
    [
        {"kv_cache_layout": "layer", "max_num_batched_tokens": 16, "min_token_bucket": 16},
        {
            "kv_cache_layout": "shuffled",
            "seed": 3,
            "max_num_batched_tokens": 16,
            "min_token_bucket": 16,
            "max_num_seqs": 2,
        },
    ],
    ids=["layer-chunked", "shuffled-chunked-2-seqs"],
)
def test_layouts_chunked_prefill_and_batching_keep_every_token(example_gguf, hf_tokens, runner):
  """The default layout (hybrid) ran above with whole prefills; these chunk every prefill into 16-token pieces, in
  one 16-token bucket (one compiled step)."""
  _, expected = hf_tokens
  llm = LLM(gguf_model_path=example_gguf, **RUN, **runner)
  outputs = llm.generate(list(PROMPTS[:3]), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
  assert [list(o.outputs[0].token_ids) for o in outputs] == expected[:3]
  assert kv_cache_checks.all_free(llm.engine.manager)
