"""Runs one vLLM `LLM` over this package's model in this process and writes what it decided and generated as JSON.

    python tests/upstream/driver.py SPEC.json OUT.json

SPEC holds `model` (a Hugging Face folder), `maxtext_config` (overrides), `prompts` (lists of token ids) or
`rounds` (lists of such lists, one `generate` call each), `max_tokens`, `engine` (further `LLM(...)` keywords;
`skip_tokenizer_init` is True unless it says otherwise), and `watch_scheduler` (optional: record what vLLM's
scheduler does, `watch_scheduler`, and the wall time of the generate calls) and `trace_resume` (optional: the
tokens the runner feeds each request resumed after a preemption, `trace_resumes`).
OUT gets the greedy tokens of each prompt (no stop at eos), the prompt tokens each request found in the prefix
cache, and the runner's layout: its KV-cache groups, block count, `layer_name_to_kvcache_index`, each physical
cache's shapes and dtypes (a recurrent state's first axis is its slot count) and the mesh. The tier runs each
engine in a process of its own, so one engine's global state (vLLM's distributed setup, jit caches) never leaks into
the next.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import stand_ins  # pylint: disable=wrong-import-position  # must come before vLLM

stand_ins.install()

# pylint: disable=wrong-import-position,wrong-import-order
import jax
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def _runner(llm: LLM):
  core = llm.llm_engine.engine_core.engine_core
  return core.model_executor.driver_worker.worker.model_runner


def _describe(cache) -> list[list]:
  leaves = cache if isinstance(cache, (tuple, list)) else [cache]
  return [[list(leaf.shape), str(leaf.dtype)] for leaf in leaves]


def layout(llm: LLM) -> dict:
  """The runner's KV-cache groups, slot map, physical caches and state-slot count."""
  runner = _runner(llm)
  config = runner.kv_cache_config
  return {
      "groups": [
          {"layers": list(group.layer_names), "spec": type(group.kv_cache_spec).__name__}
          for group in config.kv_cache_groups
      ],
      "num_blocks": int(config.num_blocks),
      "layer_name_to_kvcache_index": dict(runner.layer_name_to_kvcache_index),
      "kv_caches": [_describe(cache) for cache in runner.kv_caches],
      "mesh": {name: int(size) for name, size in runner.mesh.shape.items()},
  }


def watch_scheduler(llm: LLM) -> dict:
  """Counts what vLLM's scheduler does from now on: the requests running after each `schedule()` call, the
  preemptions, and the tokens the preempted requests had computed (which a resume without a prefix-cache hit
  computes again)."""
  scheduler = llm.llm_engine.engine_core.engine_core.scheduler
  seen = {"running": [], "preemptions": 0, "preempted_computed_tokens": 0}
  schedule, preempt = scheduler.schedule, scheduler._preempt_request  # pylint: disable=protected-access

  def counted_schedule(*args, **kwargs):
    out = schedule(*args, **kwargs)
    seen["running"].append(len(scheduler.running))
    return out

  def counted_preempt(request, *args, **kwargs):
    seen["preemptions"] += 1
    seen["preempted_computed_tokens"] += int(request.num_computed_tokens)
    return preempt(request, *args, **kwargs)

  scheduler.schedule = counted_schedule
  scheduler._preempt_request = counted_preempt  # pylint: disable=protected-access
  return seen


def trace_resumes(llm: LLM) -> list:
  """For each request resumed after a preemption, once tpu-inference's runner has taken the step's plan
  (`PersistentBatchManager.update_states`): the tokens the runner will feed it against the scheduler's."""
  runner = _runner(llm)
  scheduler = llm.llm_engine.engine_core.engine_core.scheduler
  manager = runner.persistent_batch_manager
  update = manager.update_states
  seen = []

  def traced(scheduler_output, *args, **kwargs):
    out = update(scheduler_output, *args, **kwargs)
    data = scheduler_output.scheduled_cached_reqs
    for req_id in data.req_ids:
      if req_id not in data.resumed_req_ids:
        continue
      state = manager.requests[req_id]
      request = scheduler.requests[req_id]
      index = runner.input_batch.req_id_to_index.get(req_id)
      row = runner.input_batch.token_ids_cpu[index, : request.num_tokens].tolist() if index is not None else None
      seen.append(
          {
              "request": req_id,
              "num_tokens": int(request.num_tokens),
              "runner_tokens": row,
              "scheduler_tokens": list(request.all_token_ids),
              "runner_outputs": list(state.output_token_ids),
          }
      )
    return out

  manager.update_states = traced
  return seen


def main(spec_path: str, out_path: str) -> None:
  spec = json.loads(pathlib.Path(spec_path).read_text(encoding="utf-8"))
  engine = dict(spec.get("engine", {}))
  engine.setdefault("skip_tokenizer_init", True)  # the tiny folders hold no tokenizer; prompts are token ids
  llm = LLM(
      model=spec["model"],
      hf_overrides={"architectures": ["MaxTextForCausalLM"]},
      additional_config={"maxtext_config": spec.get("maxtext_config", {})},
      **engine,
  )
  params = SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=0.0, ignore_eos=True, detokenize=False)
  tokens, cached = [], []
  seen = watch_scheduler(llm) if spec.get("watch_scheduler") else None
  resumes = trace_resumes(llm) if spec.get("trace_resume") else None
  start = time.perf_counter()
  # Each round is one generate call; a later round can hit the prefix cache of an earlier one.
  for prompts in spec.get("rounds") or [spec["prompts"]]:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    tokens += [list(out.outputs[0].token_ids) for out in outputs]
    cached += [int(out.num_cached_tokens or 0) for out in outputs]
  seconds = time.perf_counter() - start
  result = {"tokens": tokens, "num_cached_tokens": cached, "layout": layout(llm), "jax": jax.__version__}
  if seen is not None:
    result["scheduler"] = {**seen, "generate_s": seconds}
  if resumes is not None:
    result["resumes"] = resumes
  pathlib.Path(out_path).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
  main(*sys.argv[1:3])
