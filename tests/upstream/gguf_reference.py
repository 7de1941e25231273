"""Makes a GGUF checkpoint a Hugging Face folder with transformers' own GGUF loader, and transformers' greedy tokens
on it, in the main (Python 3.11) venv.

    .venv/bin/python tests/upstream/gguf_reference.py SPEC.json OUT.json

SPEC holds `gguf` (the file), `cache_dir`, `prompts` (texts) and `max_tokens`. The folder is
`cache_dir/gguf-as-hf/<SHA-256 of the file>`: transformers dequantizes every tensor to float32
(`from_pretrained(..., gguf_file=...)`), and the folder gets that state dict as model.safetensors (the tied output
head left out, as transformers saves it), config.json without the GGUF quantization entry, and the tokenizer. It is
made once per file, in a temporary folder renamed into place when complete. OUT gets `folder`, `sha256`,
`prompt_ids` (each prompt tokenized as the model's tokenizer does, BOS first) and `transformers` (float32 greedy
tokens of the folder's model, no stop at eos). It runs here and not in the vLLM venv, which has no `gguf` package.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from references import transformers_greedy  # pylint: disable=wrong-import-position

_CHUNK = 1 << 20


def sha256_of(path: pathlib.Path) -> str:
  """Hex SHA-256 of a file."""
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _write_folder(gguf: pathlib.Path, out: pathlib.Path) -> None:
  """transformers' float32 reading of the GGUF file, saved as a Hugging Face folder."""
  tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
  model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
  state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
  if model.config.tie_word_embeddings:
    del state["lm_head.weight"]  # the embedding table itself
  save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
  config = model.config.to_dict()
  config.pop("quantization_config", None)  # the folder holds dequantized float32 tensors
  (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
  tokenizer.save_pretrained(str(out))


def hf_folder(gguf: pathlib.Path, cache_dir: pathlib.Path) -> tuple[pathlib.Path, str]:
  """The cached Hugging Face folder of `gguf` (made when missing) and the file's SHA-256."""
  sha256 = sha256_of(gguf)
  folder = cache_dir / "gguf-as-hf" / sha256
  if not folder.is_dir():
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=folder.parent))
    partial.chmod(0o755)  # mkdtemp's folder is private; the cache is not
    try:
      _write_folder(gguf, partial)
      os.rename(partial, folder)
    except OSError:
      if not folder.is_dir():  # not another process that finished first
        raise
    finally:
      shutil.rmtree(partial, ignore_errors=True)
  return folder, sha256


def main(spec_path: str, out_path: str) -> None:
  spec = json.loads(pathlib.Path(spec_path).read_text(encoding="utf-8"))
  folder, sha256 = hf_folder(pathlib.Path(spec["gguf"]), pathlib.Path(spec["cache_dir"]))
  tokenizer = AutoTokenizer.from_pretrained(str(folder))
  prompt_ids = [list(tokenizer(text).input_ids) for text in spec["prompts"]]
  model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
  steps = int(spec["max_tokens"])
  tokens = [transformers_greedy(model, ids, steps) for ids in prompt_ids]
  out = {"folder": str(folder), "sha256": sha256, "prompt_ids": prompt_ids, "transformers": tokens}
  pathlib.Path(out_path).write_text(json.dumps(out), encoding="utf-8")


if __name__ == "__main__":
  main(*sys.argv[1:3])
