"""Benchmark: greedy decode tokens/s of this package beside transformers, vLLM and llama.cpp.

One invocation builds three seeded random Hugging Face checkpoints with transformers' `save_pretrained` (fp32,
hidden 512, vocab 32000, head_dim 64):
  llama       8 layers
  gemma3      12 layers, 5 sliding (window 128) : 1 full
  qwen3_next  8 layers, 3 Gated DeltaNet : 1 full attention, 16 experts top-2 plus a shared expert
then runs every peer on every checkpoint, each in its own process:
  maxtext       this package's `LLM` API over the Hugging Face folder
  transformers  `AutoModelForCausalLM.from_pretrained(...).generate(...)` (needs the hf extra)
  vllm          vLLM's CPU engine (`vllm.LLM`), only when importable by `--vllm-python` (default: this interpreter)
(the other projects' workers live in scripts/benchmark_decode_peers.py) and a JAX read-bandwidth probe (the fastest
of a few array sums, over an array moved onto 2 MiB pages as the engine moves its weights: `huge_page_weights`),
run before the first checkpoint and after each one; the roofline
uses the highest reading of the run, since a reading taken while the machine is busier is lower and would flatter
every share. Per peer and batch it reports tokens/s of one
`generate` call after a warm-up call of the same shape (best of `--repeats`), the load + first-call time, the
steady-state recompilations (this package: the engine's step traces during the timed calls; must be 0) and the
share of the memory roofline: (active weight bytes per step / read bandwidth) / measured time per step, where a
step is one token per request (the prompt's prefill is part of the timed call) and the active bytes count every
weight read in a decode step (the untied embedding table is not read; an MoE layer reads the experts its batch
selects, estimated for uniform routing). For this package it also times the decode steps themselves (the median
wall time of an engine step that only decodes: scheduling, the model, the greedy pick and the bookkeeping) and
reports their roofline share, the one a decode step reaches without the prefill. The machine's read bandwidth moves
a lot from minute to minute on a shared host, so this package's worker also pairs its steps with their own moment:
after each batch's timed calls it runs `--paired-rounds` rounds of a probe reading, one more call and another
reading, and reports the median over the rounds of each round's decode-step share against the better of its two
readings (`pair_rf`). A run's highest reading can come from a moment of much higher bandwidth than any of its steps
saw (one of four readings at 45-51 GB/s, the others at 30-34), which lowers `step_rf` for every model whatever the
steps do; `pair_rf` is the share to judge a decode step by. Whether each peer's greedy tokens equal transformers' is
reported too.

This package's load + first call is measured twice: a cold start, whose compilation cache folder is empty, and a
warm start (`wload_s`, `wfirst_s`), a second process over the folder the first one filled, as a second run of the
same model finds it; the warm start's tokens must equal the cold run's (`warm_same_tokens` in the JSON).

`--models smollm2` and `--models gemma3-270m` (not in the default list) decode a GGUF model instead (the table
GGUF_MODELS of scripts/benchmark_decode_peers.py: SmolLM2-135M-Instruct Q4_1, the README's chat prompt; Gemma 3 270M
Q4_K_M, a base model, its README prompt as raw text after BOS), from that prompt's ids (the same ids for every peer),
`--new-tokens` tokens past its end-of-text token. Its peers are this package, once per `--maxtext-variants` entry
(float32, the reference of the `same` column there; `bfloat16` = weight_dtype=bfloat16; `compact` = bfloat16 with
greedy_head_candidates=64: a tied head's int4 copy ranks the vocabulary and the greedy pick reads the table rows of
the 64 best; `int8w` = quantization=int8w over bfloat16; or any key=value: a key the config refuses fails that row
only), and `llamacpp`: llama.cpp via llama-cpp-python 0.3.36 in its own venv (`--llama-python`, default the one
scripts/setup_llama_cpp_env.sh builds), 2 threads, batch N being N sequences decoded one after another (its Python
API decodes one sequence per call); there `vs best` is the ratio to llama.cpp. transformers and vLLM run the random
checkpoints only and llama.cpp the GGUF models only; a roofline is not computed for a GGUF model. A second table
counts greedy agreement: after its timed calls each peer decodes every prompt of the model's README prompts and
example_prompts.LONG_PROMPTS once (batch 1, `--new-tokens` tokens; this package from a second LLM whose
max_target_length holds the longest), and for each peer but float32 it shows per prompt how many leading tokens
equal float32's, and their sum out of the most possible.

With `--baseline-src DIR` this package also runs from another source tree (DIR, a checkout's src/ folder, first
on the worker's PYTHONPATH) as the peer `maxtext@baseline`, right before or after this tree's run of each checkpoint
(the order alternating from one checkpoint to the next), and each row of this tree reports its tokens/s over the
baseline's (`vs base`) and whether their tokens agree (`=base`): a before/after comparison measured in one run.

Timings are measurements only; on a shared machine compare ratios from one run, not absolute numbers.

Usage: python scripts/benchmark_decode.py [--models llama gemma3 qwen3_next smollm2 gemma3-270m]
                                          [--peers maxtext transformers vllm llamacpp] [--batches 1 8]
                                          [--prompt-len 64] [--new-tokens 64] [--repeats 2] [--paired-rounds 5]
                                          [--maxtext-variants float32 bfloat16 compact int8w] [--vllm-python PATH]
                                          [--llama-python PATH] [--baseline-src DIR] [--quick] [--json]
"""

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _load_sibling(name: str) -> Any:
  """The module scripts/<name>.py (standard-library imports only: it loads in the peers' own venvs too)."""
  spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


peers_module = _load_sibling("benchmark_decode_peers")
LLAMA_CPP = peers_module.LLAMA_CPP
PEERS = ("maxtext", "transformers", "vllm", LLAMA_CPP)
_LLAMA_VENV_PYTHON = Path.home() / ".cache" / "maxtext" / "llama-cpp-python-0.3.36" / "bin" / "python"
BASELINE = "maxtext@baseline"  # this package from `--baseline-src`
LIN, FULL, SLIDE = "linear_attention", "full_attention", "sliding_attention"
_COMMON = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.05,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": None,  # no stop token: every peer generates exactly --new-tokens tokens
    "pad_token_id": 0,
}
# model name -> (transformers model_type, config kwargs)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(_COMMON, num_hidden_layers=8, tie_word_embeddings=False)),
    "gemma3": (
        "gemma3_text",
        dict(
            _COMMON,
            num_hidden_layers=12,
            layer_types=([SLIDE] * 5 + [FULL]) * 2,
            sliding_window=128,
            query_pre_attn_scalar=64,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            _COMMON,
            num_hidden_layers=8,
            num_key_value_heads=2,
            layer_types=[LIN, LIN, LIN, FULL] * 2,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    ),
}
# --quick: the same three families at test size (a few seconds per process).
_QUICK = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 32, "num_attention_heads": 4}
QUICK_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": dict(_QUICK, num_hidden_layers=2),
    "gemma3": dict(_QUICK, num_hidden_layers=3, layer_types=[SLIDE, SLIDE, FULL], sliding_window=8),
    "qwen3_next": dict(
        _QUICK,
        num_hidden_layers=4,
        layer_types=[LIN, LIN, LIN, FULL],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
}
_EXPERT_MARK = ".mlp.experts."
RESULT_MARK = "benchmark_decode result: "  # frameworks print to stdout too; the result line carries this prefix
_EMBED_MARK = "embed_tokens"


def model_config(model: str, quick: bool) -> tuple[str, dict[str, Any]]:
  """(transformers model_type, config kwargs) of `model`, at test size when `quick`."""
  model_type, kwargs = MODELS[model]
  return model_type, dict(kwargs, **QUICK_OVERRIDES[model]) if quick else dict(kwargs)


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
  """Expected number of distinct experts `num_tokens` tokens select, each `top_k` of `num_experts` uniformly."""
  return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def active_weight_bytes(tensor_bytes: dict[str, int], hf_config: dict[str, Any], batch: int) -> float:
  """Weight bytes one decode step of `batch` requests reads.

  Args:
    tensor_bytes: checkpoint tensor name -> bytes.
    hf_config: the checkpoint's config.json.
    batch: tokens in the step (one per request).

  Returns:
    Every tensor's bytes except the embedding table's (a step reads `batch` of its rows), plus the table when it is
    also the output head (tied); routed-expert tensors count for the expected share of experts the batch selects.
  """
  num_experts = int(hf_config.get("num_experts") or 0)
  expert_share = (
      expected_active_experts(num_experts, int(hf_config["num_experts_per_tok"]), batch) / num_experts
      if num_experts
      else 1.0
  )
  total = 0.0
  for name, size in tensor_bytes.items():
    if _EMBED_MARK in name:
      total += size if hf_config.get("tie_word_embeddings") else 0
    elif _EXPERT_MARK in name:
      total += size * expert_share
    else:
      total += size
  return total


# ----------------------------------------------------------------------------------------------- worker processes
# Each worker prints one JSON object on a stdout line that starts with RESULT_MARK. They import their frameworks
# lazily: the vLLM worker runs in another interpreter that has neither JAX nor this package.
# pylint: disable=import-outside-toplevel  # each worker imports only its own framework (and may lack the others)


def build_checkpoint(folder: str, model: str, quick: bool, seed: int) -> dict[str, Any]:
  """Writes a seeded random fp32 checkpoint and a WordLevel tokenizer.json over its vocabulary to `folder`."""
  import torch
  import transformers
  from safetensors import safe_open
  from tokenizers import Tokenizer, models, pre_tokenizers

  model_type, kwargs = model_config(model, quick)
  config = transformers.AutoConfig.for_model(model_type, **kwargs)
  torch.manual_seed(seed)
  hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  hf_model.save_pretrained(folder)
  vocab = {f"w{i}": i for i in range(config.vocab_size)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(os.path.join(folder, "tokenizer.json"))
  tensor_bytes = {}
  for file in sorted(Path(folder).glob("*.safetensors")):
    with safe_open(str(file), framework="pt") as f:
      for name in f.keys():
        t = f.get_slice(name)
        numel = 1
        for dim in t.get_shape():
          numel *= dim
        tensor_bytes[name] = numel * 4  # saved in fp32
  return {"params": sum(tensor_bytes.values()) // 4, "tensor_bytes": tensor_bytes}


class BandwidthProbe:
  """JAX read bandwidth: bytes over the best time of a few jitted sums of a large fp32 array, on huge pages where
  the engine would put its weights on them (`huge_page_weights`), so the roofline is read on the same footing."""

  def __init__(self, quick: bool):
    import jax
    import jax.numpy as jnp

    from maxtext.kernels.cpu import huge_pages

    self.size = (4 if quick else 64) * 2**20  # 16 MiB or 256 MiB of fp32
    self.reads = 3 if quick else 10
    self._array = jax.block_until_ready(jnp.ones((self.size,), jnp.float32))
    self.huge_page_bytes = huge_pages.collapse(huge_pages.buffer_ranges([self._array]))
    self._sum = jax.jit(jnp.sum)
    jax.block_until_ready(self._sum(self._array))

  def read(self) -> dict[str, Any]:
    """The best of `reads` sums: {"bytes", "huge_page_bytes", "best_s", "gb_per_s"}."""
    import jax

    best = float("inf")
    for _ in range(self.reads):
      start = time.perf_counter()
      jax.block_until_ready(self._sum(self._array))
      best = min(best, time.perf_counter() - start)
    nbytes = 4 * self.size
    return {"bytes": nbytes, "huge_page_bytes": self.huge_page_bytes, "best_s": best, "gb_per_s": nbytes / best / 1e9}


def measure_bandwidth(quick: bool) -> dict[str, Any]:
  """One reading of a fresh `BandwidthProbe` (the bandwidth worker)."""
  return BandwidthProbe(quick).read()


def run_maxtext(
    folder: str,
    batches: Sequence[int],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    cache_dir: str = "",
    first_call_only: bool = False,
    paired_rounds: int = 0,
    quick: bool = False,
    gguf: str = "",
    prompt_ids: Sequence[int] = (),
    overrides: Sequence[str] = (),
    model: str = "",
    agreement_ids: Sequence[Sequence[int]] = (),
) -> dict[str, Any]:
  """This package's LLM over the Hugging Face folder (or the GGUF model); also the median wall time of its decode
  steps.

  Args:
    folder, batches, prompt_len, new_tokens, repeats: as for every peer.
    cache_dir: the compilation cache folder (`compilation_cache_dir`; "" = none): empty for a cold start, the
      folder of an earlier run for a warm one.
    first_call_only: load and make each batch's first call only, returning its tokens (the warm-start run).
    paired_rounds: after each batch's timed calls, this many rounds of a bandwidth reading, one more call and
      another reading, in this process: each round's decode-step median with the better of the two readings
      around it (`paired` in the result), so a step is set against the bandwidth of its own moment.
    quick: the bandwidth probe's test size.
    gguf: the GGUF model's file, decoded instead of `folder` from `prompt_ids` (every request the same prompt),
      `new_tokens` tokens past its end-of-text token as the other peers do.
    prompt_ids: the README prompt's ids (`gguf` only); this package must give the same.
    overrides: config `key=value` strings (a `--maxtext-variants` entry).
    model: the GGUF model's name in peers_module.GGUF_MODELS (`gguf` only).
    agreement_ids: prompts decoded once each after the timed batches (`agreement_tokens`), by a second LLM whose
      max_target_length holds the longest, so the timed one keeps the README prompt's.

  Raises:
    ValueError: this package's README prompt ids are not `prompt_ids`.
  """
  from maxtext.inference import LLM, SamplingParams

  if gguf:
    prompt_len, spec = len(prompt_ids), peers_module.GGUF_MODELS[model]
    source = {"model_name": spec.model_name, "gguf_model_path": gguf, "use_chat_template": spec.use_chat_template}
  else:
    source = {"hf_model_path": folder}
  start = time.perf_counter()
  llm = LLM(
      argv=overrides,
      max_num_seqs=max(batches),
      max_num_batched_tokens=max(256, max(batches) * prompt_len),
      max_target_length=prompt_len + new_tokens,
      compilation_cache_dir=cache_dir,
      **source,
  )
  load_s = time.perf_counter() - start
  if gguf:
    own_ids = llm.prompt_token_ids(spec.prompt)
    if own_ids != list(prompt_ids):
      raise ValueError(f"the prompt's ids must be the benchmark's {list(prompt_ids)}, this package gives {own_ids}")
    # Every peer generates exactly `new_tokens` tokens: the scheduler's end-of-text stop is turned off.
    llm.engine.scheduler.eos_token_id = None
  params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
  decode_times = peers_module.time_decode_steps(llm.engine)
  out: dict[str, Any] = {"load_s": load_s, "batches": {}}
  probe: BandwidthProbe | None = None  # made after the first calls, which it would otherwise slow
  for batch in batches:
    prompts = (
        [list(prompt_ids)] * batch
        if gguf
        else peers_module.random_prompts(llm.tokenizer.vocab_size, batch, prompt_len, seed=batch)
    )
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, params, use_tqdm=False
    )  # warm-up: compiles this batch's shapes (or loads them from the cache)
    first_s = time.perf_counter() - start
    if first_call_only:
      out["batches"][str(batch)] = {"first_call_s": first_s, "tokens": peers_module.output_tokens(outputs)}
      continue
    traces = llm.engine.stats.step_traces
    decode_times.clear()
    generate = functools.partial(llm.generate, prompts, params)
    record = peers_module.timed_batch(generate, batch, new_tokens, repeats, first_s, peers_module.output_tokens)
    out["batches"][str(batch)] = {
        **record,
        "recompilations": llm.engine.stats.step_traces - traces,
        # Whole engine steps (schedule, model, greedy pick, bookkeeping) of the timed calls; None with 1 new token.
        "decode_step_s": statistics.median(decode_times) if decode_times else None,
    }
    if paired_rounds and new_tokens > 1:
      probe = probe or BandwidthProbe(quick)
      rounds = []
      for _ in range(paired_rounds):
        before = probe.read()["gb_per_s"]
        decode_times.clear()
        llm.generate(prompts, params, use_tqdm=False)
        rounds.append(
            {"gb_per_s": max(before, probe.read()["gb_per_s"]), "decode_step_s": statistics.median(decode_times)}
        )
      out["batches"][str(batch)]["paired"] = rounds
  if agreement_ids and not first_call_only:
    del llm  # one model in memory at a time
    longest = max(map(len, agreement_ids)) + new_tokens + 1  # + 1: the scoring pass below generates one token
    llm = LLM(argv=overrides, max_num_seqs=1, max_target_length=longest, compilation_cache_dir=cache_dir, **source)
    llm.engine.scheduler.eos_token_id = None
    out["agreement_tokens"] = [
        peers_module.output_tokens(llm.generate([list(i)], params, use_tqdm=False))[0] for i in agreement_ids
    ]
    out["agreement_logprobs"] = [
        scored_logprobs(llm, list(i), tokens) for i, tokens in zip(agreement_ids, out["agreement_tokens"])
    ]
  return out


def scored_logprobs(llm: Any, prompt_ids: list[int], tokens: list[int]) -> list[float]:
  """Each of `tokens`' log-probability after `prompt_ids` and the tokens before it, under `llm`'s model: its prompt
  log-probabilities over prompt + tokens (the whole-head logits, whatever path the greedy pick took)."""
  from maxtext.inference import SamplingParams

  params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
  (out,) = llm.generate([prompt_ids + tokens], params, use_tqdm=False)
  return [out.prompt_logprobs[len(prompt_ids) + k][t].logprob for k, t in enumerate(tokens)]


# pylint: enable=import-outside-toplevel
WARM = "maxtext-warm"  # a second maxtext process over the first one's compilation cache


def _worker_main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("role", choices=("build", "bandwidth", "prompt", WARM) + PEERS)
  parser.add_argument("--folder", default="")
  parser.add_argument("--gguf", default="")
  parser.add_argument("--prompt-ids", type=int, nargs="*", default=[])
  parser.add_argument("--agreement-ids", type=json.loads, default=[])
  parser.add_argument("--override", action="append", default=[])
  parser.add_argument("--model", default="llama")
  parser.add_argument("--batches", type=int, nargs="+", default=[1])
  parser.add_argument("--prompt-len", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--cache-dir", default="")
  parser.add_argument("--paired-rounds", type=int, default=0)
  args = parser.parse_args(argv)
  if args.role == "build":
    result = build_checkpoint(args.folder, args.model, args.quick, args.seed)
  elif args.role == "bandwidth":
    result = measure_bandwidth(args.quick)
  elif args.role == "prompt":
    result = peers_module.gguf_prompt_ids(args.model, args.gguf)
  elif args.role == LLAMA_CPP:
    sizes = (args.batches, args.new_tokens, args.repeats)
    result = peers_module.run_llama_cpp(args.gguf, args.prompt_ids, *sizes, agreement_ids=args.agreement_ids)
  elif args.role in ("maxtext", WARM):
    sizes = (args.folder, args.batches, args.prompt_len, args.new_tokens, args.repeats)
    result = run_maxtext(
        *sizes,
        cache_dir=args.cache_dir,
        first_call_only=args.role == WARM,
        paired_rounds=args.paired_rounds,
        quick=args.quick,
        gguf=args.gguf,
        prompt_ids=args.prompt_ids,
        overrides=args.override,
        model=args.model,
        agreement_ids=args.agreement_ids,
    )
  else:
    result = peers_module.WORKERS[args.role](args.folder, args.batches, args.prompt_len, args.new_tokens, args.repeats)
  print(RESULT_MARK + json.dumps(result), flush=True)
  return 0


# ----------------------------------------------------------------------------------------------- the driver


_WEIGHT_CACHE_DIR = ""  # the current run's weight cache folder for the workers (set by `main`)


def _env(src: str | None = None) -> dict[str, str]:
  """This environment, with `src` (default: the repository's src/) first on PYTHONPATH (a fresh checkout runs
  without install).

  A compilation cache folder set for JAX is dropped: the maxtext workers get their own (empty for the cold start),
  and the run's weight cache folder.
  """
  env = dict(os.environ)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
  src = src or str(Path(__file__).resolve().parents[1] / "src")
  env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
  if _WEIGHT_CACHE_DIR:
    env["MAXTEXT_WEIGHT_CACHE_DIR"] = _WEIGHT_CACHE_DIR  # this run's, never the user's
  return env


def run_worker(python: str, role: str, args: Sequence[str], timeout: float, src: str | None = None) -> dict[str, Any]:
  """Runs one worker process (with `src` first on its PYTHONPATH; default: this repository's src/); returns its JSON
  result, or {"error": ...} when it fails."""
  cmd = [python, str(Path(__file__).resolve()), "--_worker", role, *args]
  try:
    proc = subprocess.run(cmd, env=_env(src), capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail}"}
  return json.loads(lines[-1][len(RESULT_MARK) :])


def peer_available(python: str, module: str) -> tuple[bool, str]:
  """Whether `python` can import the peer's `module` (vllm, llama_cpp), and its version or why not."""
  try:
    proc = subprocess.run(
        [python, "-c", f"import {module}; print({module}.__version__)"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f"{python}: {e}"
  if proc.returncode != 0:
    return False, (proc.stderr.strip().splitlines() or [f"import {module} failed"])[-1]
  return True, proc.stdout.strip()


def _matches(tokens: list[list[int]] | None, reference: list[list[int]] | None) -> float | None:
  if tokens is None or reference is None:
    return None
  return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


def _is_maxtext(peer: str) -> bool:
  """Whether `peer` is this tree's run (any `--maxtext-variants` entry), not the baseline's or another project's."""
  return peer == "maxtext" or peer.startswith("maxtext:")


def summarize(
    model: str,
    checkpoint: dict[str, Any],
    hf_config: dict[str, Any],
    peers: dict[str, Any],
    gb_per_s: float,
    reference: str = "transformers",
) -> list[dict[str, Any]]:
  """One row per (model, peer, batch): tokens/s, first call, recompilations, roofline share (none without
  `checkpoint["tensor_bytes"]`), the share of requests whose tokens equal the `reference` peer's."""
  rows = []
  reference_batches = peers.get(reference, {}).get("batches", {})
  for peer, result in peers.items():
    if "error" in result:
      rows.append({"model": model, "peer": peer, "batch": None, "error": result["error"]})
      continue
    warm = result.get("warm", {})
    for batch, stats in result["batches"].items():
      step_s = stats["generate_s"] / stats.get("steps", len(stats["tokens"][0]))
      active_bytes = (
          active_weight_bytes(checkpoint["tensor_bytes"], hf_config, int(batch)) if "tensor_bytes" in checkpoint else 0
      )
      ideal_s = active_bytes / (gb_per_s * 1e9)
      paired = (stats.get("paired") or []) if active_bytes else []
      rows.append(
          {
              "model": model,
              "peer": peer,
              "batch": int(batch),
              "tokens_per_s": stats["tokens_per_s"],
              "load_s": result["load_s"],
              "first_call_s": stats["first_call_s"],
              "recompilations": stats.get("recompilations"),
              "roofline_share": ideal_s / step_s if active_bytes else None,
              "decode_step_s": stats.get("decode_step_s"),
              "decode_step_roofline_share": (
                  ideal_s / stats["decode_step_s"] if stats.get("decode_step_s") and active_bytes else None
              ),
              # Each paired round's decode steps against the bandwidth read around them, the median of the rounds.
              "paired_step_roofline_share": (
                  statistics.median(active_bytes / (r["gb_per_s"] * 1e9) / r["decode_step_s"] for r in paired)
                  if paired
                  else None
              ),
              "paired_gb_per_s": [r["gb_per_s"] for r in paired] if paired else None,
              "reference": reference,
              "same_tokens_as_reference": _matches(stats["tokens"], reference_batches.get(batch, {}).get("tokens")),
          }
      )
      if peer == "maxtext":
        # The warm start: a second process over the compilation cache the first one filled.
        warm_stats = warm.get("batches", {}).get(batch, {})
        rows[-1]["warm_error"] = warm.get("error")
        rows[-1]["warm_load_s"] = warm.get("load_s")
        rows[-1]["warm_first_call_s"] = warm_stats.get("first_call_s")
        rows[-1]["warm_same_tokens"] = _matches(warm_stats.get("tokens"), stats["tokens"])
  best: dict[tuple[str, int], float] = {}
  for row in rows:
    if row.get("batch") is not None and not _is_maxtext(row["peer"]) and row["peer"] != BASELINE:
      key = (row["model"], row["batch"])
      best[key] = max(best.get(key, 0.0), row["tokens_per_s"])
  for row in rows:
    if row.get("batch") is not None and _is_maxtext(row["peer"]) and (row["model"], row["batch"]) in best:
      row["ratio_to_best_peer"] = row["tokens_per_s"] / best[(row["model"], row["batch"])]
  baseline = peers.get(BASELINE, {}).get("batches", {})
  for row in rows:
    base = baseline.get(str(row.get("batch")))
    if row.get("batch") is not None and row["peer"] == "maxtext" and base:
      row["ratio_to_baseline"] = row["tokens_per_s"] / base["tokens_per_s"]
      row["same_tokens_as_baseline"] = _matches(peers["maxtext"]["batches"][str(row["batch"])]["tokens"], base["tokens"])
  return rows


def _cell(value: float | None, scale: float = 1.0) -> str:
  """A table cell: `value * scale` with two decimals, or "-" when there is no value."""
  return "-" if value is None else f"{value * scale:.2f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """Human-readable table of `summarize` rows."""
  header = (
      f"{'model':<11} {'peer':<16} {'batch':>5} {'tok/s':>8} {'vs best':>7} {'load_s':>7} {'first_s':>7} "
      f"{'wload_s':>7} {'wfirst_s':>8} {'recomp':>6} {'roofline':>8} {'step_ms':>7} {'step_rf':>7} {'pair_rf':>7} "
      f"{'same':>5} {'vs base':>7} {'=base':>5}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    if row.get("batch") is None:
      lines.append(f"{row['model']:<11} {row['peer']:<16} not run: {row['error']}")
      continue
    ratio = _cell(row.get("ratio_to_best_peer"))
    recomp = "-" if row["recompilations"] is None else str(row["recompilations"])
    same = _cell(row["same_tokens_as_reference"])
    step_ms = _cell(row.get("decode_step_s"), scale=1e3)
    step_rf = _cell(row.get("decode_step_roofline_share"))
    pair_rf = _cell(row.get("paired_step_roofline_share"))
    warm_load, warm_first = _cell(row.get("warm_load_s")), _cell(row.get("warm_first_call_s"))
    vs_base, same_base = _cell(row.get("ratio_to_baseline")), _cell(row.get("same_tokens_as_baseline"))
    lines.append(
        f"{row['model']:<11} {row['peer']:<16} {row['batch']:>5} {row['tokens_per_s']:>8.1f} {ratio:>7} "
        f"{row['load_s']:>7.2f} {row['first_call_s']:>7.2f} {warm_load:>7} {warm_first:>8} {recomp:>6} "
        f"{_cell(row['roofline_share']):>8} {step_ms:>7} {step_rf:>7} {pair_rf:>7} {same:>5} {vs_base:>7} {same_base:>5}"
    )
    if row.get("warm_error"):
      lines.append(f"{row['model']:<11} {'maxtext':<16} warm start not run: {row['warm_error']}")
  return "\n".join(lines)


def _run_job(
    job: str,
    unsupported: str | None,
    run_args: list[str],
    variants: dict[str, tuple[str, ...]],
    float32_args: list[str],
    pythons: dict[str, str],
    timeout: float,
) -> dict[str, Any]:
  """One peer's worker on one model (`unsupported`: the kind of model the peer runs instead, when it cannot run
  this one); `pythons` holds the vLLM and llama.cpp interpreters and the baseline's source tree."""
  if unsupported:
    only = "the GGUF models" if unsupported == "GGUF" else "the random checkpoints"
    return {"error": f"{job} runs {only} only"}
  if job == BASELINE:
    return run_worker(sys.executable, "maxtext", run_args, timeout, src=pythons[BASELINE])
  if _is_maxtext(job):
    extra = [arg for override in variants[job] for arg in ("--override", override)]
    return run_worker(sys.executable, "maxtext", run_args + extra + (float32_args if job == "maxtext" else []), timeout)
  return run_worker(pythons.get(job, sys.executable), job, run_args, timeout)


def _random_model(model: str, tmp: str, seed: int, quick: list[str], timeout: float) -> tuple[dict, dict, str]:
  """Builds `model`'s seeded random checkpoint under `tmp`: (its sizes, its config.json, its folder)."""
  folder = os.path.join(tmp, model)
  checkpoint = run_worker(
      sys.executable, "build", ["--folder", folder, "--model", model, "--seed", str(seed)] + quick, timeout
  )
  if "error" in checkpoint:
    raise SystemExit(f"benchmark_decode: building the {model} checkpoint failed: {checkpoint['error']}")
  return checkpoint, json.loads(Path(folder, "config.json").read_text(encoding="utf-8")), folder


def _probe_bandwidth(quick: list[str], timeout: float) -> dict[str, Any]:
  """One bandwidth probe in its own process; exits with a message when it fails."""
  probe = run_worker(sys.executable, "bandwidth", quick, timeout)
  if "error" in probe:
    raise SystemExit(f"benchmark_decode: the bandwidth probe failed: {probe['error']}")
  return probe


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--_worker"]:
    return _worker_main(argv[1:])
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--models",
      choices=tuple(MODELS) + tuple(peers_module.GGUF_MODELS),
      nargs="+",
      default=list(MODELS),
      help=f"checkpoints to run (default: the random ones; {', '.join(peers_module.GGUF_MODELS)}: GGUF models)",
  )
  parser.add_argument("--peers", choices=PEERS, nargs="+", default=list(PEERS), help="implementations to run")
  parser.add_argument("--batches", type=_positive_int, nargs="+", default=None, help="requests per call (1 8)")
  parser.add_argument("--prompt-len", type=_positive_int, default=None, help="prompt tokens per request (64)")
  parser.add_argument("--new-tokens", type=_positive_int, default=None, help="generated tokens per request (64)")
  parser.add_argument("--repeats", type=_positive_int, default=None, help="timed calls per batch, best kept (2)")
  parser.add_argument(
      "--paired-rounds", type=_positive_int, default=None, help="this package: bandwidth read beside its calls (5)"
  )
  parser.add_argument("--seed", type=int, default=0, help="seed of the random checkpoints")
  parser.add_argument(
      "--maxtext-variants",
      nargs="+",
      default=["float32"],
      help="this package's runs: float32, bfloat16 (weight_dtype), compact, int8w (quantization) or key=value",
  )
  parser.add_argument("--vllm-python", default=sys.executable, help="interpreter that has vllm (its own venv)")
  parser.add_argument(
      "--llama-python",
      default=str(_LLAMA_VENV_PYTHON) if _LLAMA_VENV_PYTHON.exists() else sys.executable,
      help="interpreter that has llama_cpp (scripts/setup_llama_cpp_env.sh); batch N = N sequences one after another",
  )
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
  parser.add_argument("--quick", action="store_true", help="test-size models, batches 1 2, 8 + 4 tokens, 1 repeat")
  parser.add_argument(
      "--baseline-src", default="", help=f"also run this package from DIR (a checkout's src/) as {BASELINE}"
  )
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  args = parser.parse_args(argv)
  if args.baseline_src and not Path(args.baseline_src, "maxtext", "__init__.py").is_file():
    parser.error(f"--baseline-src {args.baseline_src}: must be a src/ folder holding the maxtext package")
  batches = args.batches or ([1, 2] if args.quick else [1, 8])
  prompt_len = args.prompt_len or (8 if args.quick else 64)
  new_tokens = args.new_tokens or (4 if args.quick else 64)
  repeats = args.repeats or (1 if args.quick else 2)
  paired_rounds = args.paired_rounds or (2 if args.quick else 5)
  quick = ["--quick"] if args.quick else []
  variants: dict[str, tuple[str, ...]] = {}
  for variant in args.maxtext_variants:
    try:
      variants[peers_module.variant_peer(variant)] = peers_module.variant_overrides(variant)
    except ValueError as e:
      parser.error(f"--maxtext-variants: {e}")
  notes = {}
  peers = list(args.peers)
  for peer, module, python in (("vllm", "vllm", args.vllm_python), (LLAMA_CPP, "llama_cpp", args.llama_python)):
    if peer in peers:
      ok, why = peer_available(python, module)
      notes[peer] = why
      if not ok:
        peers.remove(peer)
  if LLAMA_CPP in peers:
    notes[LLAMA_CPP] += f", {peers_module.LLAMA_CPP_THREADS} threads; batch N = N sequences decoded one after another"
  if "maxtext" in peers:  # this package once per variant, float32 first when asked for
    at = peers.index("maxtext")
    peers[at : at + 1] = list(variants)
  probes = [_probe_bandwidth(quick, args.timeout)]
  runs = []
  with tempfile.TemporaryDirectory(prefix="benchmark_decode_") as tmp:
    # The workers' weight cache (`_env`): empty for the cold start, filled by it for the warm one.
    global _WEIGHT_CACHE_DIR  # pylint: disable=global-statement  # one run's folder, read by `_env`
    _WEIGHT_CACHE_DIR = os.path.join(tmp, "weights")
    for model in args.models:
      sizes = ["--batches", *map(str, batches), "--new-tokens", str(new_tokens), "--repeats", str(repeats)]
      if model in peers_module.GGUF_MODELS:
        checkpoint, hf_config, run_args = peers_module.gguf_model(model, run_worker, args.timeout)
        run_args += sizes
        notes[model] = peers_module.prompt_note(model, checkpoint)
        reference, unsupported = "maxtext", {"transformers": "random", "vllm": "random"}
      else:
        checkpoint, hf_config, folder = _random_model(model, tmp, args.seed, quick, args.timeout)
        run_args = ["--folder", folder, "--prompt-len", str(prompt_len)] + sizes
        reference, unsupported = "transformers", {LLAMA_CPP: "GGUF"}
      cache_args = ["--cache-dir", os.path.join(tmp, f"{model}-compilation-cache")]  # empty: a cold start
      paired_args = ["--paired-rounds", str(paired_rounds)] + quick
      jobs = list(peers)
      if args.baseline_src and "maxtext" in jobs:
        # Beside this tree's run, before it for every other checkpoint: neither side always runs first.
        jobs.insert(jobs.index("maxtext") + (len(runs) % 2), BASELINE)
      pythons = {"vllm": args.vllm_python, LLAMA_CPP: args.llama_python, BASELINE: args.baseline_src}
      float32_args = cache_args + paired_args  # the cold and warm starts and the pairing: float32's only
      results = {
          job: _run_job(job, unsupported.get(job), run_args, variants, float32_args, pythons, args.timeout)
          for job in jobs
      }
      if "maxtext" in results and "error" not in results["maxtext"]:
        results["maxtext"]["warm"] = run_worker(sys.executable, WARM, run_args + cache_args, args.timeout)
      runs.append((model, checkpoint, hf_config, results, reference))
      probes.append(_probe_bandwidth(quick, args.timeout))
  best_probe = max(probes, key=lambda probe: probe["gb_per_s"])
  bandwidth = dict(best_probe, probes_gb_per_s=[probe["gb_per_s"] for probe in probes])
  rows = [
      dict(row, params=checkpoint.get("params"))
      for model, checkpoint, hf_config, results, reference in runs
      for row in summarize(model, checkpoint, hf_config, results, bandwidth["gb_per_s"], reference)
  ]
  agreement = [row for model, _, _, results, _ in runs for row in peers_module.agreement_rows(model, results)]
  settings = {
      "baseline_src": args.baseline_src or None,
      "batches": batches,
      "prompt_len": prompt_len,
      "new_tokens": new_tokens,
      "repeats": repeats,
      "paired_rounds": paired_rounds,
      "maxtext_variants": {peer: list(overrides) for peer, overrides in variants.items()},
  }
  if args.json:
    report = {"settings": settings, "bandwidth": bandwidth, "notes": notes, "results": rows, "agreement": agreement}
    print(json.dumps(report))
  else:
    print(
        f"prompt {prompt_len} + {new_tokens} new tokens, greedy, fp32 random checkpoints, best of {repeats}; "
        f"`same` against transformers (random) or maxtext (float32; GGUF); JAX read bandwidth "
        f"{bandwidth['gb_per_s']:.1f} GB/s (the highest of {len(probes)} probes: "
        f"{', '.join(f'{gb:.1f}' for gb in bandwidth['probes_gb_per_s'])})"
    )
    for peer, note in notes.items():
      print(f"{peer}: {note}")
    print(format_table(rows))
    if agreement:
      print(peers_module.format_agreement(agreement, new_tokens))
  return 0


if __name__ == "__main__":
  sys.exit(main())
