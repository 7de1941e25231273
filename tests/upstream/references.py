"""Builds the upstream tier's tiny Hugging Face folders and their reference tokens, in the main (Python 3.11) venv.

    .venv/bin/python tests/upstream/references.py OUT_DIR CASES.json

CASES.json maps a case name to `{"family": <tests/hf_cases.py case>, "prompts": [[ids], ...], "max_tokens": N,
"maxtext_config": {...}, "kv_shared_layers": [i, ...]}` (the last two optional). For each case this writes a
folder (config.json + model.safetensors, by transformers' save_pretrained) once per family, and `OUT_DIR/<case>.json`
with the greedy tokens of transformers (`generate`, no eos stop) and of this package's own engine over the same
folder. A case with `kv_shared_layers` gets a copy of the folder without those layers' K/V projections and norms
(they read an earlier layer's cache, configured by `maxtext_config`'s `num_kv_shared_layers`); transformers has
no such model, so only this package's tokens are given (`"transformers": null`). It runs here and not in the vLLM
venv because that venv pins an older transformers than some families need, and a CUDA torch.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for hf_cases
from hf_cases import build_hf_model  # pylint: disable=wrong-import-position

from maxtext.checkpoint import load_run_config  # pylint: disable=wrong-import-position
from maxtext.inference.engine import LLMEngine  # pylint: disable=wrong-import-position
from maxtext.inference.sampling_params import SamplingParams  # pylint: disable=wrong-import-position


def transformers_greedy(model, prompt: list[int], steps: int) -> list[int]:
  """transformers' greedy decoding of `steps` tokens (no early stop at eos).

  The attention mask is given: without one, `generate` masks out every prompt token equal to the model's pad id.
  """
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps, min_new_tokens=steps
    )
  return [int(t) for t in out[0, len(prompt) :]]


def maxtext_greedy(folder: pathlib.Path, prompts: list[list[int]], steps: int, overrides: dict) -> list[list[int]]:
  """This package's engine over the folder, all prompts at once (no eos stop, as the other two run)."""
  cfg = load_run_config(hf_model_path=str(folder), **overrides)
  engine = LLMEngine(cfg)
  ids = engine.add_requests([(p, SamplingParams(max_tokens=steps, temperature=0.0)) for p in prompts])
  done = {}
  while engine.has_unfinished_requests():
    for finished in engine.step():
      done[finished.request_id] = [int(t) for t in finished.output_token_ids]
  return [done[i] for i in ids]


def _without_kv_of(folder: pathlib.Path, out: pathlib.Path, layers: list[int]) -> pathlib.Path:
  """A copy of `folder` whose `layers` have no K/V projections or K norm (KV-sharing layers own none)."""
  out.mkdir(parents=True, exist_ok=True)
  dropped = tuple(f"model.layers.{i}.self_attn.{n}." for i in layers for n in ("k_proj", "v_proj", "k_norm"))
  tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith(dropped)}
  save_file(tensors, str(out / "model.safetensors"))
  shutil.copy(folder / "config.json", out / "config.json")
  return out


def main(out_dir: str, cases_path: str) -> None:
  out = pathlib.Path(out_dir)
  cases = json.loads(pathlib.Path(cases_path).read_text(encoding="utf-8"))
  models = {}
  for name, case in cases.items():
    family = case["family"]
    folder = out / family
    if family not in models:
      models[family] = build_hf_model(family)
      models[family].save_pretrained(str(folder))
    prompts, steps = case["prompts"], int(case["max_tokens"])
    shared = case.get("kv_shared_layers")
    if shared:
      folder = _without_kv_of(folder, out / name, shared)
    reference = {
        "folder": str(folder),
        "transformers": None if shared else [transformers_greedy(models[family], p, steps) for p in prompts],
        "maxtext": maxtext_greedy(folder, prompts, steps, case.get("maxtext_config", {})),
    }
    (out / f"{name}.json").write_text(json.dumps(reference), encoding="utf-8")
    print(f"{name}: maxtext {np.asarray(reference['maxtext']).shape}", file=sys.stderr)


if __name__ == "__main__":
  main(*sys.argv[1:3])
