"""The other projects' workers of scripts/benchmark_decode.py and its real model (loaded by it; not run alone).

The random checkpoints' peers: transformers' `generate` and vLLM's CPU engine (in the interpreter `--vllm-python`).

The GGUF models (`GGUF_MODELS`; fetched once by scripts/fetch_example_model.py) decode their README prompt
(scripts/example_prompts.py): `smollm2`, SmolLM2-135M-Instruct as a Q4_1 file, "What is the capital of France?" as
one user message through the model's own chat template; `gemma3-270m`, Gemma 3 270M (a base model) as a Q4_K_M
file, "The capital of France is" as raw text after its BOS token, no chat template. The greedy agreement prompts are
the README prompt and `LONG_PROMPTS`, made the same way. Every prompt's ids are computed once, by this package's
tokenizer, and every peer decodes exactly those ids. The peer `llamacpp` is llama.cpp through llama-cpp-python, in
its own venv (scripts/setup_llama_cpp_env.sh; `--llama-python`), with 2 threads.

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
from typing import Any, NamedTuple


def _load_sibling(name: str) -> Any:
  """The module scripts/<name>.py (standard-library imports only)."""
  spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


example_prompts = _load_sibling("example_prompts")


class GgufModel(NamedTuple):
  """A GGUF model of `--models`: its config, its file and how its prompts are made."""

  model_name: str  # configs/models/<model_name>.yml
  fetch_model: str | None  # fetch_example_model.fetch(model=...); None: fetch()'s default file
  use_chat_template: bool  # the prompt as one user message through the chat template, else raw text after BOS

  @property
  def prompt(self) -> str:
    """The README prompt, the one the speed rows decode."""
    return example_prompts.README_PROMPTS[self.model_name][0]

  @property
  def agreement_prompts(self) -> tuple[str, ...]:
    """The prompts of the greedy agreement counts."""
    return example_prompts.README_PROMPTS[self.model_name] + example_prompts.LONG_PROMPTS


GGUF_MODELS: dict[str, GgufModel] = {
    "smollm2": GgufModel("smollm2-135m-instruct", None, use_chat_template=True),
    "gemma3-270m": GgufModel("gemma3-270m", "gemma3-270m", use_chat_template=False),  # a base model
}
LLAMA_CPP = "llamacpp"
LLAMA_CPP_THREADS = 2
# --maxtext-variants names -> this package's config overrides (any other `key=value` is passed as it is).
VARIANTS: dict[str, tuple[str, ...]] = {
    "float32": (),
    "bfloat16": ("weight_dtype=bfloat16",),
    "int8w": ("weight_dtype=bfloat16", "quantization=int8w"),  # int8w keeps what it does not quantize in bfloat16
    # A tied head's int4 copy ranks the vocabulary; the greedy pick reads the table rows of the 64 best only.
    "compact": ("weight_dtype=bfloat16", "greedy_head_candidates=64"),
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


def fetch_gguf(model: str) -> str:
  """`model`'s GGUF path (scripts/fetch_example_model.py: verified, downloaded only when missing)."""
  fetch_model = GGUF_MODELS[model].fetch_model
  fetch = _load_sibling("fetch_example_model").fetch
  return fetch() if fetch_model is None else fetch(model=fetch_model)


def gguf_model(model: str, run_worker: Callable[..., dict[str, Any]], timeout: float) -> tuple[dict, dict, list[str]]:
  """The GGUF `model` (fetched when missing) and its prompts' ids, by benchmark_decode's `run_worker`.

  Returns:
    ({"prompt_ids": [...], "agreement_prompt_ids": [[...], ...]}, {} (no config.json), the worker arguments naming
    the model, the file and the ids).
  """
  try:
    gguf = fetch_gguf(model)
  except RuntimeError as e:
    raise SystemExit(f"benchmark_decode: fetching the {model} model failed: {e}") from e
  prompt = run_worker(sys.executable, "prompt", ["--model", model, "--gguf", gguf], timeout)
  if "error" in prompt:
    raise SystemExit(f"benchmark_decode: the {model} prompt ids failed: {prompt['error']}")
  ids = ["--prompt-ids", *map(str, prompt["prompt_ids"]), "--agreement-ids", json.dumps(prompt["agreement_prompt_ids"])]
  return prompt, {}, ["--model", model, "--gguf", gguf, *ids]


def prompt_note(model: str, checkpoint: dict[str, Any]) -> str:
  """The table's note on a GGUF model's prompts."""
  spec = GGUF_MODELS[model]
  how = "through the chat template" if spec.use_chat_template else "after BOS, no chat template"
  lengths = ", ".join(str(len(ids)) for ids in checkpoint["agreement_prompt_ids"])
  return f"{spec.prompt!r} {how}: {len(checkpoint['prompt_ids'])} prompt ids; agreement prompts {lengths} ids"


# pylint: disable=import-outside-toplevel  # each worker imports only its own framework (and may lack the others)


def gguf_prompt_ids(model: str, gguf: str) -> dict[str, Any]:
  """The GGUF `model`'s prompts as token ids, by this package's tokenizer of `gguf` (the `prompt` worker).

  Returns:
    {"prompt_ids": [...], "agreement_prompt_ids": [[...], ...]}: the ids `LLM(...).prompt_token_ids(prompt)` gives
    under the model's config (`use_chat_template` as GGUF_MODELS says); the maxtext workers check theirs against
    them.
  """
  from maxtext.checkpoint import load_run_config
  from maxtext.inference.chat_template import render_chat_template
  from maxtext.inference.tokenizer import tokenizer_from_config

  spec = GGUF_MODELS[model]
  tokenizer = tokenizer_from_config(load_run_config([], model_name=spec.model_name, gguf_model_path=gguf))

  def ids(prompt: str) -> list[int]:
    if not spec.use_chat_template:
      return tokenizer.encode(prompt, add_bos=True)
    text = render_chat_template(
        tokenizer.chat_template,
        [{"role": "user", "content": prompt}],
        bos_token=tokenizer.token_text(tokenizer.bos_token_id),
        eos_token=tokenizer.token_text(tokenizer.eos_token_id),
        add_generation_prompt=True,
        source=gguf,
    )
    return tokenizer.encode(text, add_special_tokens=False)

  return {"prompt_ids": ids(spec.prompt), "agreement_prompt_ids": [ids(p) for p in spec.agreement_prompts]}


def run_llama_cpp(
    gguf: str,
    prompt_ids: Sequence[int],
    batches: Sequence[int],
    new_tokens: int,
    repeats: int,
    agreement_ids: Sequence[Sequence[int]] = (),
) -> dict[str, Any]:
  """llama.cpp (llama-cpp-python, in its own venv), greedy, `LLAMA_CPP_THREADS` threads, on the GGUF's own blocks.

  Its Python API decodes one sequence per call, so batch N is N sequences decoded one after another; each starts
  from an empty cache (a fresh prefill, as the other peers do it) and runs `new_tokens` tokens, past the end-of-text
  token as the other peers do. After the timed batches, each of `agreement_ids` is decoded once the same way
  (`agreement_tokens`); the context holds the longest prompt.
  """
  import llama_cpp  # pylint: disable=import-error  # only in the llama.cpp venv (--llama-python)

  prompt = [int(t) for t in prompt_ids]
  start = time.perf_counter()
  llm = llama_cpp.Llama(
      model_path=gguf,
      n_ctx=max(map(len, [prompt, *agreement_ids])) + new_tokens,
      n_threads=LLAMA_CPP_THREADS,
      n_threads_batch=LLAMA_CPP_THREADS,
      seed=0,
      verbose=False,
  )
  load_s = time.perf_counter() - start

  def one_sequence(ids: Sequence[int] = prompt) -> list[int]:
    llm.reset()  # otherwise `generate` reuses the cached prompt of the previous sequence
    tokens: list[int] = []
    sequence = [int(t) for t in ids]
    for token in llm.generate(sequence, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
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
  if agreement_ids:
    out["agreement_tokens"] = [one_sequence(ids) for ids in agreement_ids]
  return out


def leading_agreement(tokens: Sequence[int], reference: Sequence[int]) -> int:
  """How many leading tokens of `tokens` equal `reference`'s."""
  count = 0
  for a, b in zip(tokens, reference):
    if a != b:
      break
    count += 1
  return count


def agreement_rows(model: str, results: dict[str, Any], reference: str = "maxtext") -> list[dict[str, Any]]:
  """Per peer other than `reference` with `agreement_tokens`: the leading greedy tokens equal to the reference's
  on each agreement prompt (`counts`) and their sum; none when the reference has no agreement tokens.

  With `agreement_logprobs` on both sides (this package's peers score their own tokens), `max_dlogprob` and
  `mean_dlogprob` are the largest and the mean |difference| of the two log-probabilities over the leading tokens
  they agree on (None otherwise): how far a compact form's model is from float32's where their paths coincide.
  """
  reference_tokens = results.get(reference, {}).get("agreement_tokens")
  if not reference_tokens:
    return []
  reference_logprobs = results[reference].get("agreement_logprobs")
  rows = []
  for peer, result in results.items():
    if peer != reference and result.get("agreement_tokens"):
      counts = [leading_agreement(t, r) for t, r in zip(result["agreement_tokens"], reference_tokens)]
      row = {"model": model, "peer": peer, "reference": reference, "counts": counts, "sum": sum(counts)}
      row["max_dlogprob"] = row["mean_dlogprob"] = None
      logprobs = result.get("agreement_logprobs")
      if logprobs and reference_logprobs:
        diffs = [abs(a - b) for n, x, y in zip(counts, logprobs, reference_logprobs) for a, b in zip(x[:n], y[:n])]
        if diffs:
          row["max_dlogprob"], row["mean_dlogprob"] = max(diffs), sum(diffs) / len(diffs)
      rows.append(row)
  return rows


def format_agreement(rows: Sequence[dict[str, Any]], new_tokens: int) -> str:
  """The greedy agreement table of `agreement_rows` (`-` where a peer has no log-probabilities)."""
  header = (
      f"{'model':<11} {'peer':<18} {'leading tokens = ' + rows[0]['reference'] + ' (float32), per prompt':<48}"
      f" {'sum':<11} {'max|dlp|':>8} {'mean|dlp|':>9}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    counts = "[" + ", ".join(str(c) for c in row["counts"]) + "]"
    total = f"{row['sum']} / {new_tokens * len(row['counts'])}"
    worst, mean = (_cell_float(row.get(k)) for k in ("max_dlogprob", "mean_dlogprob"))
    lines.append(f"{row['model']:<11} {row['peer']:<18} {counts:<48} {total:<11} {worst:>8} {mean:>9}")
  return "\n".join(lines)


def _cell_float(value: float | None) -> str:
  return "-" if value is None else f"{value:.4f}"


def time_decode_steps(engine: Any) -> list[float]:
  """Wraps this package's `engine.step` to record the wall time of every pure-decode step (each scheduled token
  is sampled).

  Returns the list the times are appended to; a step that prefills (more tokens scheduled than sampled) is skipped.
  """
  times: list[float] = []
  step = engine.step

  def timed_step():
    scheduled, generated = engine.stats.scheduled_tokens, engine.stats.generated_tokens
    start = time.perf_counter()
    finished = step()
    elapsed = time.perf_counter() - start
    if engine.stats.scheduled_tokens - scheduled == engine.stats.generated_tokens - generated > 0:
      times.append(elapsed)
    return finished

  engine.step = timed_step
  return times


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
