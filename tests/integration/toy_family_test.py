"""A model family defined outside the package, in two files, loads from a Hugging Face folder and decodes.

The family, `toy_qwen`, is Qwen3's block (RMSNorm on every query and key head) stored under other checkpoint names:
the MLP as `feed_forward.`, its norm as `pre_ff_layernorm`, the final norm as `model.final_layernorm` (the names
Bamba's checkpoints use). Everything it takes is written here into a temporary folder, as docs/architecture.md's
checklist says: the module with its `Family` record, which registers itself when imported (its registry entry),
and its model YAML. A fresh interpreter imports that module and loads a Hugging Face folder of the family
(config.json, safetensors and a tokenizer.json, written here) through the package's own paths: `load_hf_model`
for the dense forward and `LLM(hf_model_path=...)` for a greedy decode. The same weights under Qwen3's names,
loaded as the registered `qwen3` family, must give the same logits, bit for bit, and the same tokens.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import maxtext
from maxtext.checkpoint import hf_layout
from maxtext.checkpoint.hf import load_hf_config, load_hf_model
from maxtext.inference import LLM, SamplingParams

# The family's module: its record and its registration, all it takes for a block the layers already compute.
FAMILY_MODULE = '''
"""toy_qwen: Qwen3's block, stored as Bamba stores its MLP and norms."""

from maxtext.configs.families import Family, HFMapping, TensorLayout, Traits, register_family
from maxtext.configs.families.family import FFN_FEED_FORWARD
from maxtext.configs.families.hf_fields import given_layer_types
from maxtext.configs.layer_kinds import FULL_ATTENTION


def _layer_types(fields, num_layers):
  return given_layer_types(fields, num_layers) or [FULL_ATTENTION] * num_layers


FAMILY = register_family(
    Family(
        name="toy_qwen",
        traits=Traits(qk_norm=True),
        hf=HFMapping(model_types={"toy_qwen": {"rope_theta": 10000.0}}, layer_types=_layer_types),
        tensors=TensorLayout(
            pre_mlp_norm="pre_ff_layernorm", final_norm="model.final_layernorm.weight", ffn=FFN_FEED_FORWARD
        ),
    )
)
'''

# Its model YAML (laid over the package's base.yml), the sizes of qwen3-tiny.
MODEL_YAML = """
base_config: "base.yml"
decoder_block: "toy_qwen"
base_emb_dim: 64
base_num_decoder_layers: 2
base_num_query_heads: 4
base_num_kv_heads: 2
head_dim: 32
base_mlp_dim: 160
vocab_size: 512
mlp_activations: ["silu", "linear"]
normalization_layer_epsilon: 1.0e-6
logits_via_embedding: true
rope_max_timescale: 1000000.0
"""

HF_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
}
PROMPT = [5, 17, 300, 42, 9, 128, 77]
MAX_TOKENS = 5
RUN = {"max_num_seqs": 2, "max_target_length": 64, "kernel_backend": "reference", "weight_cache": False}

# Runs in a fresh interpreter (the registry of this one stays as the package defines it): imports the family's
# module, checks its YAML against its Hugging Face mapping, and writes the logits and greedy tokens.
DRIVER = """
import json, sys
import jax.numpy as jnp
import numpy as np
import toy_family
from maxtext.checkpoint.hf import load_hf_model
from maxtext.configs import load_config
from maxtext.inference import LLM, SamplingParams

folder, yaml, out, prompt, run = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
cfg, model = load_hf_model(folder, progress=False)
from_yaml = load_config([yaml])
differ = [k for k in ("decoder_block", "layer_types", "base_emb_dim", "head_dim", "base_mlp_dim", "use_qk_norm",
                      "logits_via_embedding", "rope_max_timescale") if cfg[k] != from_yaml[k]]
logits = np.asarray(model(jnp.asarray([prompt], jnp.int32)))
llm = LLM(yaml, hf_model_path=folder, **run)
tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=int(sys.argv[6])))[0].outputs[0].token_ids
np.savez(out, logits=logits, tokens=np.asarray(tokens), differ=np.asarray(differ, dtype=str),
         family=np.asarray(toy_family.FAMILY.name))
"""

# Qwen3's checkpoint names -> the toy family's (after `model.layers.{i}.` for the per-layer ones).
_RENAMES = {"post_attention_layernorm.": "pre_ff_layernorm.", "mlp.": "feed_forward."}


def _toy_name(name: str) -> str:
  if name == "model.norm.weight":
    return "model.final_layernorm.weight"
  for old, new in _RENAMES.items():
    name = name.replace(f".{old}", f".{new}")
  return name


def _write_folder(folder: pathlib.Path, model_type: str, tensors: dict[str, np.ndarray] | None) -> pathlib.Path:
  """config.json and, with `tensors`, model.safetensors and a WordLevel tokenizer.json over the 512 ids."""
  folder.mkdir()
  if tensors is not None:
    save_file(tensors, str(folder / "model.safetensors"))
    from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel  # the hf extra

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "config.json").write_text(json.dumps({"model_type": model_type, **HF_CONFIG}), encoding="utf-8")
  return folder


@pytest.fixture(name="folders", scope="module")
def _folders(tmp_path_factory):
  """(qwen3 folder, toy_qwen folder, the family's folder of code): the same weights under both families' names."""
  root = tmp_path_factory.mktemp("toy_family")
  cfg = load_hf_config(_write_folder(root / "config", "qwen3", None))
  rng = np.random.default_rng(0)
  tensors = {}
  for recipe in hf_layout.build_recipes(cfg):
    for name, shape in zip(recipe.sources, recipe.source_shapes):
      mean = 1.0 if name.endswith("norm.weight") else 0.0  # norms near one, as trained ones are
      tensors[name] = (mean + 0.1 * rng.standard_normal(shape)).astype(np.float32)
  qwen3 = _write_folder(root / "qwen3", "qwen3", tensors)
  toy = _write_folder(root / "toy_qwen", "toy_qwen", {_toy_name(n): t for n, t in tensors.items()})
  code = root / "code"
  code.mkdir()
  (code / "toy_family.py").write_text(FAMILY_MODULE, encoding="utf-8")
  (code / "toy-tiny.yml").write_text(MODEL_YAML, encoding="utf-8")
  return qwen3, toy, code


def _run_toy(toy: pathlib.Path, code: pathlib.Path, out: pathlib.Path) -> dict[str, np.ndarray]:
  src = pathlib.Path(maxtext.__file__).resolve().parents[1]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(src)])}
  args = [str(toy), str(code / "toy-tiny.yml"), str(out), json.dumps(PROMPT), json.dumps(RUN), str(MAX_TOKENS)]
  proc = subprocess.run(
      [sys.executable, "-c", DRIVER, *args], env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with np.load(out) as data:
    return {k: data[k] for k in data.files}


@pytest.mark.hf  # tokenizers writes the folders' tokenizer.json
@pytest.mark.slow
def test_a_family_in_a_temporary_module_loads_and_decodes_as_the_family_it_renames(folders, tmp_path):
  qwen3, toy, code = folders
  assert sorted(p.name for p in code.iterdir()) == ["toy-tiny.yml", "toy_family.py"]  # the family's whole code
  result = _run_toy(toy, code, tmp_path / "toy.npz")
  assert str(result["family"]) == "toy_qwen" and not result["differ"].size, result["differ"]

  cfg, model = load_hf_model(qwen3, progress=False)
  assert cfg.decoder_block == "qwen3"
  np.testing.assert_array_equal(result["logits"], np.asarray(model(jnp.asarray([PROMPT], jnp.int32))))
  llm = LLM(hf_model_path=str(qwen3), **RUN)
  tokens = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0].token_ids
  assert list(result["tokens"]) == list(tokens) and len(tokens) == MAX_TOKENS
  logits = result["logits"][0]
  assert int(np.argmax(logits[-1])) == tokens[0]  # the decode's first token is the dense forward's greedy pick
