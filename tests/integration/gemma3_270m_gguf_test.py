"""The README's second example model, Gemma 3 270M (Q4_K_M GGUF), against transformers loading the same file.

transformers dequantizes the K-quant blocks with its own code (`from_pretrained(folder, gguf_file=name)`) and runs
its own Gemma 3 in float32; this package reads the file with its own GGUF reader and tokenizer and decodes through
the reference runner. The prompts are the README's and two longer than the 512-token sliding window
(scripts/example_prompts.py), so the decode reads sliding layers whose window has left the prompt's start. The
prompt ids (with BOS) and the greedy tokens must be equal; the compact form (bfloat16 with the coarse int4 head)
must pick exactly the tokens bfloat16 picks with its full head. The file is fetched once per machine
(tests/conftest.py, `gemma3_270m_gguf`).
"""

import importlib.util
import os
import pathlib

import pytest

from maxtext.inference import LLM, SamplingParams
from maxtext.kernels.cpu import cpu_gemm

pytestmark = [pytest.mark.hf, pytest.mark.slow]

_SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
MAX_TOKENS = 32
RUN = {"model_name": "gemma3-270m", "max_num_seqs": 3}


def _example_prompts():
  spec = importlib.util.spec_from_file_location("example_prompts", _SCRIPTS / "example_prompts.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return (*module.README_PROMPTS["gemma3-270m"], *module.LONG_PROMPTS)


PROMPTS = _example_prompts()


@pytest.fixture(name="expected", scope="module")
def fixture_expected(gemma3_270m_gguf):
  """transformers' prompt ids and greedy tokens for PROMPTS, float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(gemma3_270m_gguf)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
  prompt_ids, tokens = [], []
  for prompt in PROMPTS:
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    prompt_ids.append(list(ids))
    tokens.append(out[0, len(ids) :].tolist())
  return prompt_ids, tokens


def _generate(gguf: str, prompts=PROMPTS, **overrides):
  llm = LLM(gguf_model_path=gguf, **RUN, **overrides)
  return llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def test_the_prompts_cross_the_sliding_window():
  assert max(len(p) for p in PROMPTS) > 4 * 512  # characters; the token counts are checked below


def test_float32_prompt_ids_and_greedy_tokens_equal_transformers(gemma3_270m_gguf, expected):
  prompt_ids, tokens = expected
  assert prompt_ids[0][0] == 2 and max(len(ids) for ids in prompt_ids) > 2 * 512  # BOS; both windows crossed
  outputs = _generate(gemma3_270m_gguf)
  assert [list(o.prompt_token_ids) for o in outputs] == prompt_ids
  assert [list(o.outputs[0].token_ids) for o in outputs] == tokens
  assert outputs[0].outputs[0].text.startswith(" the capital of the country of France.")


@pytest.mark.skipif(cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA")
def test_the_coarse_head_picks_the_tokens_the_full_bfloat16_head_picks(gemma3_270m_gguf):
  """The README prompt only: the cpu backend's prefill of the long prompts takes minutes on two cores, and the coarse
  head changes nothing but the decode steps' picks."""
  compact = {"kernel_backend": "cpu", "weight_dtype": "bfloat16", "dtype": "bfloat16", "prompts": PROMPTS[:1]}
  full = _generate(gemma3_270m_gguf, **compact)
  coarse = _generate(gemma3_270m_gguf, **compact, greedy_head_candidates=64)
  assert len(full[0].outputs[0].token_ids) == MAX_TOKENS
  assert [list(o.outputs[0].token_ids) for o in coarse] == [list(o.outputs[0].token_ids) for o in full]
