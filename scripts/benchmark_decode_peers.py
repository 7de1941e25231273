"""The other projects' workers of scripts/benchmark_decode.py and its real model (loaded by it; not run alone).

The random checkpoints' peers: transformers' `generate` and vLLM's CPU engine (in the interpreter `--vllm-python`).

`--models smollm2` decodes the README's example model, SmolLM2-135M-Instruct as a Q4_1 GGUF file (fetched once by
scripts/fetch_example_model.py), from the README's chat prompt: "What is the capital of France?" as one user message
through the model's own chat template. The prompt's ids are computed once, by this package's tokenizer, and every
peer decodes exactly those ids. The peer `llamacpp` is llama.cpp through llama-cpp-python, in its own venv
(scripts/setup_llama_cpp_env.sh; `--llama-python`), with 2 threads.

Workers here import their frameworks lazily: `run_llama_cpp` runs in the llama.cpp venv, which has neither JAX nor
this package; the module's own imports are the standard library's only.
"""

import functools
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MODEL = "smollm2"
MODEL_NAME = "smollm2-135m-instruct"  # configs/models/<MODEL_NAME>.yml
PROMPT = "What is the capital of France?"
LLAMA_CPP = "llamacpp"
LLAMA_CPP_THREADS = 2
# --maxtext-variants names -> this package's config overrides (any other `key=value` is passed as it is).
VARIANTS: dict[str, tuple[str, ...]] = {
    "float32": (),
    "bfloat16": ("weight_dtype=bfloat16",),
    "int8w": ("weight_dtype=bfloat16", "quantization=int8w"),  # int8w keeps what it does not quantize in bfloat16
}


def variant_overrides(variant: str) -> tuple[str, ...]:
  """The config overrides of a `--maxtext-variants` entry: a name of VARIANTS, or `key=value` itself.

  Raises:
    ValueError: `variant` is neither a known name nor `key=value` with a non-empty key.
  """
  if variant in VARIANTS:
    return VARIANTS[variant]
  key, sep, _ = variant.partition("=")
  if not sep or not key.strip():
    raise ValueError(f"a maxtext variant must be one of {sorted(VARIANTS)} or key=value, got {variant!r}")
  return (variant,)


def variant_peer(variant: str) -> str:
  """The peer name of a variant's rows: `maxtext` for float32 (the reference of the other variants), else
  `maxtext:<variant>`."""
  return "maxtext" if variant == "float32" else f"maxtext:{variant}"


def fetch_gguf() -> str:
  """The example model's GGUF path (scripts/fetch_example_model.py: verified, downloaded only when missing)."""
  path = Path(__file__).resolve().with_name("fetch_example_model.py")
  spec = importlib.util.spec_from_file_location("fetch_example_model", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.fetch()


def gguf_model(run_worker: Callable[..., dict[str, Any]], timeout: float) -> tuple[dict, dict, list[str]]:
  """The example GGUF model (fetched when missing) and its chat prompt's ids, by benchmark_decode's `run_worker`.

  Returns:
    ({"prompt_ids": [...]}, {} (no config.json), the worker arguments naming the file and the ids).
  """
  try:
    gguf = fetch_gguf()
  except RuntimeError as e:
    raise SystemExit(f"benchmark_decode: fetching the {MODEL} model failed: {e}") from e
  prompt = run_worker(sys.executable, "prompt", ["--gguf", gguf], timeout)
  if "error" in prompt:
    raise SystemExit(f"benchmark_decode: the {MODEL} chat prompt failed: {prompt['error']}")
  return prompt, {}, ["--gguf", gguf, "--prompt-ids", *map(str, prompt["prompt_ids"])]


# pylint: disable=import-outside-toplevel  # each worker imports only its own framework (and may lack the others)


def chat_prompt_ids(gguf: str) -> dict[str, Any]:
  """The README's chat prompt as token ids, by this package's tokenizer of `gguf` (the `prompt` worker).

  Returns:
    {"prompt_ids": [...]}: the ids `LLM(..., use_chat_template=True).prompt_token_ids(PROMPT)` gives; the maxtext
    workers check theirs against them.
  """
  from maxtext.checkpoint import load_run_config
  from maxtext.inference.chat_template import render_chat_template
  from maxtext.inference.tokenizer import tokenizer_from_config

  tokenizer = tokenizer_from_config(load_run_config([], model_name=MODEL_NAME, gguf_model_path=gguf))
  text = render_chat_template(
      tokenizer.chat_template,
      [{"role": "user", "content": PROMPT}],
      bos_token=tokenizer.token_text(tokenizer.bos_token_id),
      eos_token=tokenizer.token_text(tokenizer.eos_token_id),
      add_generation_prompt=True,
      source=gguf,
  )
  return {"prompt_ids": tokenizer.encode(text, add_special_tokens=False)}


def run_llama_cpp(
    gguf: str, prompt_ids: Sequence[int], batches: Sequence[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
  """llama.cpp (llama-cpp-python, in its own venv), greedy, `LLAMA_CPP_THREADS` threads, on the GGUF's own blocks.

  Its Python API decodes one sequence per call, so batch N is N sequences decoded one after another; each starts
  from an empty cache (a fresh prefill, as the other peers do it) and runs `new_tokens` tokens, past the end-of-text
  token as the other peers do.
  """
  import llama_cpp  # pylint: disable=import-error  # only in the llama.cpp venv (--llama-python)

  prompt = [int(t) for t in prompt_ids]
  start = time.perf_counter()
  llm = llama_cpp.Llama(
      model_path=gguf,
      n_ctx=len(prompt) + new_tokens,
      n_threads=LLAMA_CPP_THREADS,
      n_threads_batch=LLAMA_CPP_THREADS,
      seed=0,
      verbose=False,
  )
  load_s = time.perf_counter() - start

  def one_sequence() -> list[int]:
    llm.reset()  # otherwise `generate` reuses the cached prompt of the previous sequence
    tokens: list[int] = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
      tokens.append(int(token))
      if len(tokens) == new_tokens:
        break
    return tokens

  def sequences(count: int) -> list[list[int]]:
    return [one_sequence() for _ in range(count)]

  out: dict[str, Any] = {"load_s": load_s, "version": llama_cpp.__version__, "batches": {}}
  for batch in batches:
    start = time.perf_counter()
    sequences(batch)
    first_s = time.perf_counter() - start
    out["batches"][str(batch)] = timed_batch(functools.partial(sequences, batch), batch, new_tokens, repeats, first_s)
  return out


def timed_batch(
    call: Callable[[], Any],
    batch: int,
    new_tokens: int,
    repeats: int,
    first_s: float,
    tokens_of: Callable[[Any], Any] = lambda result: result,
) -> dict[str, Any]:
  """One batch's record: `call` (a generation of `new_tokens` tokens for each of `batch` sequences) timed `repeats`
  times after a warm-up call that took `first_s`. The fastest call counts; the tokens are `tokens_of` the last call's
  result, taken outside the timing."""
  best, result = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    result = call()
    best = min(best, time.perf_counter() - start)
  return {
      "first_call_s": first_s,
      "generate_s": best,
      "tokens_per_s": batch * new_tokens / best,
      "tokens": tokens_of(result),
  }


def output_tokens(outputs: Sequence[Any]) -> list[list[int]]:
  """The generated token ids of each of vLLM's (or this package's) request outputs."""
  return [list(o.outputs[0].token_ids) for o in outputs]


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
  """`batch` seeded random prompts of `prompt_len` ids in [3, vocab_size)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  return rng.integers(3, vocab_size, size=(batch, prompt_len)).tolist()


def run_transformers(
    folder: str, batches: Sequence[int], prompt_len: int, new_tokens: int, repeats: int
) -> dict[str, Any]:
  """transformers' `generate`, greedy, fp32."""
  import torch
  import transformers

  start = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  load_s = time.perf_counter() - start
  out: dict[str, Any] = {"load_s": load_s, "torch_threads": torch.get_num_threads(), "batches": {}}
  kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
  for batch in batches:
    ids = torch.tensor(random_prompts(model.config.vocab_size, batch, prompt_len, seed=batch))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
      start = time.perf_counter()
      model.generate(ids, attention_mask=mask, **kwargs)
      first_s = time.perf_counter() - start
      generate = functools.partial(model.generate, ids, attention_mask=mask, **kwargs)
      out["batches"][str(batch)] = timed_batch(
          generate, batch, new_tokens, repeats, first_s, lambda result: result[:, prompt_len:].tolist()
      )
  return out


def run_vllm(folder: str, batches: Sequence[int], prompt_len: int, new_tokens: int, repeats: int) -> dict[str, Any]:
  """vLLM's CPU engine (its own interpreter), greedy; the dtype of the checkpoint's config (fp32)."""
  import vllm  # pylint: disable=import-error  # only in the vLLM venv (--vllm-python)

  vocab_size = json.loads(Path(folder, "config.json").read_text(encoding="utf-8"))["vocab_size"]
  start = time.perf_counter()
  llm = vllm.LLM(
      model=folder,
      dtype="float32",
      skip_tokenizer_init=True,
      max_model_len=prompt_len + new_tokens,
      max_num_seqs=max(batches),
      seed=0,
  )
  load_s = time.perf_counter() - start
  params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
  out: dict[str, Any] = {"load_s": load_s, "version": vllm.__version__, "batches": {}}
  for batch in batches:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(vocab_size, batch, prompt_len, seed=batch)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    first_s = time.perf_counter() - start
    generate = functools.partial(llm.generate, prompts, params, use_tqdm=False)
    out["batches"][str(batch)] = timed_batch(generate, batch, new_tokens, repeats, first_s, output_tokens)
  return out


# pylint: enable=import-outside-toplevel
WORKERS = {"transformers": run_transformers, "vllm": run_vllm}  # the random checkpoints' other peers
