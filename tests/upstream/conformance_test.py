"""One vLLM program, two engines: conformance_program.py run with `vllm.LLM` (vLLM 0.32 and tpu-inference's real
runner on the CPU, this package's model through the plugin) and with `maxtext.inference.LLM` (the main venv), over
the same folder (serve_model.py's tiny Llama with a trained tokenizer and a chat template, plus a
generation_config.json with sampling fields). Greedy tokens and text are identical, logprobs and prompt logprobs
within 1e-4 with the same ids and ranks, finish and stop reasons the same, and this package's output classes have
no field vLLM's lack. docs/serving.md's conformance table says what differs and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cases
import serve
import stand_ins

TOLERANCE = 1e-4
TIMEOUT_S = 600
# The folder's sampling defaults, which both engines' `get_default_sampling_params()` must read.
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 6}
REPO = serve.HERE.parents[1]
VLLM_ONLY_REQUEST_FIELDS = {
    "encoder_prompt",
    "encoder_prompt_token_ids",
    "kv_transfer_params",
    "ec_transfer_params",
    "lora_request",
    "num_cache_creation_tokens",
    "prompt_token_id_logprobs",
}
VLLM_ONLY_COMPLETION_FIELDS = {
    "lora_request",
    "routed_experts",
    "sampling_mask",
    "spec_decode_metrics",
    "weight_versions",
}


def _main_python() -> str:
  return os.environ.get("MAXTEXT_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))


def _main_env() -> dict[str, str]:
  path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


@pytest.fixture(name="runs", scope="module")
def fixture_runs(tmp_path_factory, scratch_home) -> dict[str, dict]:
  """`{"vllm": result, "maxtext": result}`: the program's JSON from each engine, run side by side."""
  work = tmp_path_factory.mktemp("conformance")
  folder = work / "model"
  subprocess.run(
      [_main_python(), str(serve.HERE / "serve_model.py"), "build", str(folder)],
      check=True,
      timeout=TIMEOUT_S,
      env=_main_env(),
      stdout=subprocess.DEVNULL,
  )
  generation = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
  (folder / "generation_config.json").write_text(json.dumps({**generation, **GENERATION_DEFAULTS}), encoding="utf-8")
  length = {"max_model_len": cases.SERVE_MAX_MODEL_LEN, "max_num_seqs": 8}
  specs = {
      "vllm": {
          "hf_overrides": {"architectures": ["MaxTextForCausalLM"]},
          "additional_config": {"maxtext_config": dict(cases.MAXTEXT_CONFIG)},
          "dtype": "float32",
          **length,
      },
      "maxtext": {**cases.MAXTEXT_CONFIG, **length},
  }
  vllm_env = {**os.environ, **stand_ins.environment(), "HOME": str(scratch_home)}
  commands = {"vllm": (sys.executable, vllm_env), "maxtext": (_main_python(), _main_env())}
  processes = {}
  for engine, (python, env) in commands.items():
    spec = work / f"{engine}.spec.json"
    spec.write_text(json.dumps({"model": str(folder), "llm_kwargs": specs[engine]}), encoding="utf-8")
    log = (work / f"{engine}.log").open("w")
    program = [python, str(serve.HERE / "conformance_program.py"), engine, str(spec), str(work / f"{engine}.json")]
    processes[engine] = (subprocess.Popen(program, env=env, stdout=log, stderr=subprocess.STDOUT), log)  # pylint: disable=consider-using-with
  for engine, (process, log) in processes.items():
    try:
      process.wait(timeout=TIMEOUT_S)
    finally:
      if process.poll() is None:
        process.kill()
      log.close()
    tail = (work / f"{engine}.log").read_text(encoding="utf-8")[-4000:]
    assert process.returncode == 0, f"the program failed on {engine}:\n{tail}"
  return {engine: json.loads((work / f"{engine}.json").read_text(encoding="utf-8")) for engine in commands}


def _same_logprobs(ours: list | None, theirs: list | None, where: str) -> None:
  """Per position: the same token ids in the same order, ranks and decoded tokens equal, logprobs within 1e-4."""
  assert (ours is None) == (theirs is None), where
  if ours is None:
    return
  assert len(ours) == len(theirs), where
  for i, (a, b) in enumerate(zip(ours, theirs)):
    assert (a is None) == (b is None), f"{where}[{i}]"
    if a is None:
      continue
    assert [t for t, *_ in a] == [t for t, *_ in b], f"{where}[{i}]"
    assert [rank for _, _, rank, _ in a] == [rank for _, _, rank, _ in b], f"{where}[{i}]"
    assert [text for *_, text in a] == [text for *_, text in b], f"{where}[{i}]"
    for (_, x, _, _), (_, y, _, _) in zip(a, b):
      assert abs(x - y) < TOLERANCE, f"{where}[{i}]: {x} vs {y}"


def _same_outputs(ours: list[dict], theirs: list[dict], section: str) -> None:
  """Request by request: prompt, prompt ids and logprobs, and each completion's tokens, text, reasons, logprobs."""
  assert len(ours) == len(theirs), section
  for k, (a, b) in enumerate(zip(ours, theirs)):
    where = f"{section}[{k}]"
    assert (a["prompt"], a["prompt_token_ids"], a["finished"]) == (b["prompt"], b["prompt_token_ids"], b["finished"])
    _same_logprobs(a["prompt_logprobs"], b["prompt_logprobs"], f"{where}.prompt_logprobs")
    assert len(a["outputs"]) == len(b["outputs"]), where
    for x, y in zip(a["outputs"], b["outputs"]):
      same = ("index", "token_ids", "text", "finish_reason", "stop_reason", "finished")
      assert {f: x[f] for f in same} == {f: y[f] for f in same}, where
      _same_logprobs(x["logprobs"], y["logprobs"], f"{where}.logprobs")
      assert (x["cumulative_logprob"] is None) == (y["cumulative_logprob"] is None), where
      if x["cumulative_logprob"] is not None:
        assert abs(x["cumulative_logprob"] - y["cumulative_logprob"]) < TOLERANCE * len(x["token_ids"]), where


@pytest.mark.parametrize("section", ["greedy", "stop", "n_greedy", "chat"])
def test_deterministic_sections_are_the_same_on_both_engines(runs, section):
  _same_outputs(runs["maxtext"][section], runs["vllm"][section], section)


def test_the_greedy_section_exercises_what_it_claims(runs):
  greedy = runs["vllm"]["greedy"]
  assert all(len(o["outputs"][0]["token_ids"]) > 1 for o in greedy)
  assert all(o["prompt_logprobs"][0] is None and len(o["prompt_logprobs"]) == len(o["prompt_token_ids"]) for o in greedy)
  # logprobs=3: the sampled token and the three most likely (the sampled one among them when greedy).
  assert all(len(p) == 3 for o in greedy for p in o["outputs"][0]["logprobs"])
  stop, (cut, kept) = runs["vllm"]["stop_string"], runs["vllm"]["stop"]
  assert stop and cut["outputs"][0]["stop_reason"] == stop == kept["outputs"][0]["stop_reason"]
  assert kept["outputs"][0]["text"] == cut["outputs"][0]["text"] + stop
  n_greedy = runs["vllm"]["n_greedy"][0]["outputs"]
  assert [c["index"] for c in n_greedy] == [0, 1]
  assert n_greedy[0]["token_ids"] == n_greedy[1]["token_ids"] == greedy[0]["outputs"][0]["token_ids"]


def test_penalties_apply_here_and_tpu_inference_ignores_them(runs):
  # tpu-inference 0.32's sampler reads temperature, top_k and top_p only (`TPUSupportedSamplingMetadata`): with the
  # three penalties its tokens are the plain greedy ones. This engine applies them as vLLM defines them (the
  # sampler's unit tests check the values), so a prompt whose greedy answer repeats a token differs.
  greedy = [o["outputs"][0]["token_ids"] for o in runs["vllm"]["greedy"]]
  assert [o["outputs"][0]["token_ids"] for o in runs["vllm"]["penalties"]] == greedy
  ours = [o["outputs"][0]["token_ids"] for o in runs["maxtext"]["penalties"]]
  repeats = [i for i, tokens in enumerate(greedy) if len(set(tokens)) < len(tokens)]
  assert repeats and all(ours[i] != greedy[i] for i in repeats)
  assert all(len(set(ours[i])) == len(ours[i]) for i in repeats)  # the penalties removed the repeats


def test_sampled_sections_have_the_same_structure(runs):
  for section, max_tokens in (("sampled", 8), ("no_params", GENERATION_DEFAULTS["max_new_tokens"])):
    for engine in ("vllm", "maxtext"):
      for output in runs[engine][section]:
        assert [c["index"] for c in output["outputs"]] == list(range(len(output["outputs"]))), (engine, section)
        for c in output["outputs"]:
          assert 1 <= len(c["token_ids"]) <= max_tokens and c["finish_reason"] in ("stop", "length"), (engine, section)
    assert [len(o["outputs"]) for o in runs["maxtext"][section]] == [len(o["outputs"]) for o in runs["vllm"][section]]


def test_default_sampling_params_come_from_the_folders_generation_config(runs):
  expected = {**GENERATION_DEFAULTS, "max_tokens": GENERATION_DEFAULTS["max_new_tokens"]}
  del expected["max_new_tokens"]
  for engine in ("vllm", "maxtext"):
    assert {k: runs[engine]["default_params"][k] for k in expected} == expected, engine
  assert runs["maxtext"]["default_params"] == runs["vllm"]["default_params"]


def test_a_per_request_seed_is_refused_by_tpu_inference_and_honoured_here(runs):
  assert "JAX does not support per-request seed" in runs["vllm"]["request_seed"]["error"]
  assert runs["maxtext"]["request_seed"] == {"tokens": 4}


def test_this_packages_output_classes_have_no_field_vllms_lack(runs):
  ours, theirs = runs["maxtext"]["fields"], runs["vllm"]["fields"]
  for cls in ("RequestOutput", "CompletionOutput", "Logprob"):
    assert set(ours[cls]) <= set(theirs[cls]), (cls, set(ours[cls]) - set(theirs[cls]))
  assert ours["Logprob"] == theirs["Logprob"]
  # What vLLM's have besides (docs/serving.md's table says why this package leaves them out).
  assert set(theirs["RequestOutput"]) - set(ours["RequestOutput"]) == VLLM_ONLY_REQUEST_FIELDS
  assert set(theirs["CompletionOutput"]) - set(ours["CompletionOutput"]) == VLLM_ONLY_COMPLETION_FIELDS


def test_the_tokenizers_agree(runs):
  assert runs["maxtext"]["tokenizer"] == runs["vllm"]["tokenizer"]
