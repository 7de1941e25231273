"""Every family under vLLM 0.32.0 + tpu-inference 0.32.0's real runner: the same greedy tokens as this package's
own engine and as transformers, the layout the runner allocated, and this package's replica of the runner's
decisions checked against it.

Attention-only families run on the stock runner; the others need docs/tpu-inference-kv-cache-spec.patch, without
which tpu-inference gives every layer a full-attention spec (no sliding windows, no recurrent states).
"""

from __future__ import annotations

import json

import pytest

import cases

# The replica forms vLLM's groups and tpu-inference's shared arrays (src/maxtext/kv_cache/kv_cache_groups.py); the
# runner's recorded layout must equal it exactly (docs/runner-contract.md, "The replica and the real runner").
_SPEC_KINDS = {"FullAttentionSpec": "attention", "SlidingWindowSpec": "attention", "MambaSpec": "recurrent"}


def _family_run(case: str, references: dict, run_vllm) -> dict:
  _, patched = cases.FAMILIES[case]
  return run_vllm(references[case]["folder"], patched=patched)


@pytest.mark.parametrize("case", list(cases.FAMILIES))
def test_family_decodes_like_transformers_and_maxtext(case, references, run_vllm):
  reference = references[case]
  assert reference["maxtext"] == reference["transformers"]  # the two references agree first
  result = _family_run(case, references, run_vllm)
  assert result["tokens"] == reference["transformers"]
  print(case, json.dumps(result["layout"]))


def _replica(folder: str, **overrides) -> dict:
  """What this package's reference runner decides for the same model and engine settings."""
  # pylint: disable=import-outside-toplevel  # imported in the test process, after the tier's environment is set
  from maxtext.checkpoint import load_run_config
  from maxtext.inference.engine_build import make_kv_cache_manager

  engine = {**cases.ENGINE, **overrides.pop("engine", {})}
  cfg = load_run_config(
      hf_model_path=folder,
      kernel_backend="reference",
      block_size=engine["block_size"],
      num_kv_blocks=engine["num_gpu_blocks_override"],
      max_num_seqs=engine["max_num_seqs"],
      max_target_length=engine["max_model_len"],
      kv_cache_layout="hybrid",
      hybrid_kv_cache=True,
      **overrides,
  )
  manager = make_kv_cache_manager(cfg)
  slots = manager.describe_slots()
  shared = {f"layer.{i}" for i, source in enumerate(cfg.kv_shared_source) if source >= 0}
  return {
      "groups": [(g.kind, [n for n in g.layer_names if n not in shared]) for g in manager.groups],
      "layer_name_to_kvcache_index": dict(manager.layer_name_to_kvcache_index),
      "slots": [([list(s) for s in slot.shapes], list(slot.dtypes)) for slot in slots],
      "num_state_slots": manager.num_state_slots if manager.has_recurrent else None,
  }


def _check_replica(upstream: dict, ours: dict) -> None:
  """The replica's groups (kinds, members, order), slot map and per-array shapes equal the runner's."""
  assert [(_SPEC_KINDS[g["spec"]], g["layers"]) for g in upstream["groups"]] == ours["groups"]
  up_map, our_map = upstream["layer_name_to_kvcache_index"], ours["layer_name_to_kvcache_index"]
  assert our_map == up_map
  assert len(upstream["kv_caches"]) == len(ours["slots"])
  for up_cache, (our_shapes, our_dtypes) in zip(upstream["kv_caches"], ours["slots"]):
    assert [shape[1:] for shape, _ in up_cache] == [shape[1:] for shape in our_shapes]
    assert [dtype for _, dtype in up_cache] == our_dtypes
  recurrent = [layer for kind, layers in ours["groups"] if kind == "recurrent" for layer in layers]
  if recurrent:  # one slot per request the runner holds, plus the null slot
    assert {upstream["kv_caches"][up_map[layer]][0][0][0] for layer in recurrent} == {ours["num_state_slots"]}


@pytest.mark.parametrize("case", list(cases.FAMILIES))
def test_the_replica_decides_what_the_runner_decides(case, references, run_vllm):
  """Groups, slot map, every array's per-block (or per-slot) shapes and dtypes, and the state-slot count are the
  runner's, exactly."""
  upstream = _family_run(case, references, run_vllm)["layout"]
  _check_replica(upstream, _replica(references[case]["folder"]))


def test_the_replica_decides_what_the_runner_decides_with_kv_sharing(references, run_vllm):
  """KV-shared layers map to their sources' arrays; gemma3's owners 0-3 form four one-layer groups."""
  reference = references["gemma3_kv_sharing"]
  config = cases.KV_SHARING["maxtext_config"]
  upstream = run_vllm(reference["folder"], patched=True, maxtext_config=config)["layout"]
  _check_replica(upstream, _replica(reference["folder"], **config))


def _arrays(layout: dict) -> list[list[str]]:
  """The layers of each physical array, by slot."""
  by_slot: dict[int, list[str]] = {}
  for layer, slot in sorted(layout["layer_name_to_kvcache_index"].items(), key=lambda kv: int(kv[0].split(".")[1])):
    by_slot.setdefault(slot, []).append(layer)
  return [by_slot[slot] for slot in sorted(by_slot)]


def _layers(*numbers: int) -> list[str]:
  return [f"layer.{i}" for i in numbers]


# The exact allocation tpu-inference 0.32.0 makes (with the spec patch) for the tiny families whose layers of
# different KV-cache groups share arrays: vLLM splits each layer kind into groups of equal size, and tpu-inference
# gives the i-th layer of every group one array.
_LAYOUTS = {
    "gemma3": (  # sliding 0, 1, 3, 4 and full 2, 5; window 16
        [_layers(0, 3), _layers(1, 4), _layers(2, 5)],
        [_layers(0, 1, 2), _layers(3, 4, 5)],
    ),
    "gpt_oss": (  # sliding 0, 2 and full 1, 3; window 8
        [_layers(0, 2), _layers(1, 3)],
        [_layers(0, 1), _layers(2, 3)],
    ),
    "qwen3_5": (  # Gated DeltaNet 0-2, 4-6 and full 3, 7: every layer keeps an array of its own
        [_layers(0, 4), _layers(1, 5), _layers(2, 6), _layers(3, 7)],
        [_layers(i) for i in (0, 4, 1, 5, 2, 6, 3, 7)],
    ),
}


@pytest.mark.parametrize("case", list(_LAYOUTS))
def test_the_runner_allocates_groups_and_shared_arrays_as_recorded(case, references, run_vllm):
  groups, arrays = _LAYOUTS[case]
  layout = _family_run(case, references, run_vllm)["layout"]
  assert [sorted(g["layers"], key=lambda n: int(n.split(".")[1])) for g in layout["groups"]] == groups
  assert _arrays(layout) == arrays


@pytest.mark.parametrize("case", list(cases.LONG))
def test_real_windows_under_the_real_runner(case, references, run_vllm):
  """Gemma3's 5:1 pattern with window 1024 and gpt-oss's window 128, prompts past the window: the tokens of
  transformers, and the runner's grouping (12 Gemma3 layers: 6 groups of 2 layers, 2 arrays of 6 layers)."""
  reference = references[case]
  result = run_vllm(
      reference["folder"], patched=True, engine=cases.LONG[case]["engine"], prompts=cases.LONG[case]["prompts"]
  )
  assert reference["maxtext"] == reference["transformers"]
  assert result["tokens"] == reference["transformers"]
  layout = result["layout"]
  if case == "gemma3_5to1":
    assert [len(g["layers"]) for g in layout["groups"]] == [2] * 6
    assert [len(layers) for layers in _arrays(layout)] == [6, 6]
  _check_replica(layout, _replica(reference["folder"], engine=cases.LONG[case]["engine"]))
  print(case, json.dumps(layout))
