"""`python -m maxtext.decode` in a subprocess, as a user runs it: stdout, stderr and the exit status.

Sources: random weights from a bundled tiny config, a Hugging Face folder (config.json, safetensors and a
tokenizer.json written here), an Orbax checkpoint written by `save_params`, and a converted checkpoint
(`convert_hf_checkpoint`) next to a config-only Hugging Face folder. Tokens are checked against references that
do not use the runner: the dense full-sequence forward run greedily, and transformers' own forward.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import param_checks
from maxtext.checkpoint import save_params
from maxtext.checkpoint.convert import convert
from maxtext.configs import load_config
from maxtext.inference import LLM, SamplingParams
from maxtext.models import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[2]
EOS = 2
PAD_TO = 32
ERROR_PREFIX = "maxtext-decode: error: "


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


def _run_all(*arg_lists):
  """Runs `python -m maxtext.decode <args>` once per list, concurrently; returns [(status, stdout, stderr)]."""
  procs = [
      subprocess.Popen(  # pylint: disable=consider-using-with  # all start before any is awaited
          [sys.executable, "-m", "maxtext.decode", *args],
          cwd=ROOT,
          env=_env(),
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for args in arg_lists
  ]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=300)
    results.append((proc.returncode, out, err))
  return results


def _json_request(result):
  status, out, err = result
  assert status == 0, err
  assert out.count("\n") == 1, out  # exactly one JSON document, on one line
  doc = json.loads(out)
  assert set(doc) == {"requests", "stats"}
  (request,) = doc["requests"]
  assert set(request) == {"prompt_token_ids", "output_token_ids", "text", "finish_reason", "logprobs"}
  return request


def _dense_greedy(model, prompt, max_tokens):
  """Greedy tokens of the dense full-sequence forward (padded buffer; the forward is causal), stopping at eos."""
  forward = jax.jit(lambda tokens: model(tokens[None])[0])
  tokens, out = list(prompt), []
  for _ in range(max_tokens):
    padded = jnp.asarray(tokens + [0] * (PAD_TO - len(tokens)), jnp.int32)
    out.append(int(jnp.argmax(forward(padded)[len(tokens) - 1])))
    tokens.append(out[-1])
    if out[-1] == EOS:
      break
  return out


def _check_length(request, max_tokens):
  if request["finish_reason"] == "stop":
    assert request["output_token_ids"][-1] == EOS
  else:
    assert request["finish_reason"] == "length" and len(request["output_token_ids"]) == max_tokens


@pytest.mark.slow
def test_json_and_text_output_match_the_in_process_llm_and_the_dense_greedy_forward():
  # vocab_size=259: every non-special id is a byte, so the text is not empty.
  args = ["configs/base.yml", "model_name=llama-tiny", "vocab_size=259", "prompt=I love to", "max_new_tokens=6"]
  runs = _run_all(args + ["output_format=json", "logprobs=2"], args)
  json_run, text_run = runs[0], runs[1]
  request = _json_request(json_run)
  assert request["prompt_token_ids"] == [1] + [b + 3 for b in b"I love to"]
  _check_length(request, 6)

  llm = LLM(str(ROOT / "configs" / "base.yml"), argv=args[1:])
  (expected,) = llm.generate("I love to", SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))
  assert request["output_token_ids"] == list(expected.outputs[0].token_ids)
  assert request["output_token_ids"] == _dense_greedy(
      param_checks.canonical_model(llm.engine), request["prompt_token_ids"], 6
  )
  assert request["text"] == expected.outputs[0].text
  assert request["text"] == bytes(t - 3 for t in request["output_token_ids"] if 3 <= t < 259).decode(
      "utf-8", errors="replace"
  )
  assert len(request["logprobs"]) == len(request["output_token_ids"])
  for lp, token, want in zip(request["logprobs"], expected.outputs[0].token_ids, expected.outputs[0].logprobs):
    assert lp["token_id"] == token and len(lp["top"]) == 2
    by_rank = sorted(want.items(), key=lambda item: item[1].rank)
    assert [t for t, _ in lp["top"]] == [t for t, _ in by_rank[:2]]
    np.testing.assert_allclose(lp["logprob"], want[token].logprob, atol=1e-5)

  status, out, err = text_run
  assert status == 0, err
  assert out == request["text"] + "\n"
  assert "Traceback" not in err


def test_dry_run_prints_the_layout_of_every_layer_and_help_exits_0():
  # kvshare-tiny: 6 layers, the last two reuse earlier layers' caches, so there are 4 slots.
  runs = _run_all(["configs/base.yml", "model_name=kvshare-tiny", "dry_run=true"], ["--help"])
  status, out, err = runs[0]
  assert status == 0, err
  assert "generating" not in err  # no model step ran
  num_layers = load_config(model_name="kvshare-tiny").base_num_decoder_layers
  assert {int(i) for i in re.findall(r"\blayer\.(\d+)\b", out)} == set(range(num_layers))
  slots = [line for line in out.splitlines() if line.startswith("kv_caches[")]
  assert (
      len(slots) == 4 and sum(", layer." in line.split(" attention")[0] for line in slots) == 2
  )  # a reader beside its source
  assert sum(line.startswith("total: ") for line in out.splitlines()) == 1
  status, out, err = runs[1]
  assert status == 0 and out.startswith("usage: maxtext-decode") and err == ""


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_on_stderr():
  cases = {
      "unknown key": (["configs/base.yml", "foo=1"], "unknown config key 'foo'"),
      "not an int": (["configs/base.yml", "max_new_tokens=abc"], "max_new_tokens='abc'"),
      "bad choice": (["configs/base.yml", "kv_cache_layout=zigzag"], "kv_cache_layout='zigzag': must be one of"),
      "no hf folder": (["configs/base.yml", "hf_model_path=/nonexistent"], "'/nonexistent' does not exist"),
      "no orbax dir": (["configs/base.yml", "load_parameters_path=/nonexistent"], "'/nonexistent' does not exist"),
      "no base yml": (["configs/missing.yml", "max_new_tokens=2"], "config file 'configs/missing.yml' does not exist"),
  }
  results = _run_all(*(args for args, _ in cases.values()))
  for (name, (_, message)), (status, out, err) in zip(cases.items(), results):
    assert status == 2, (name, err)
    assert out == "", name
    assert len(err.splitlines()) == 1 and err.startswith(ERROR_PREFIX) and message in err, (name, err)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints as the source.


def _write_hf_folder(folder):
  """A tiny random Qwen3 (tied embeddings) saved by transformers, and a WordLevel tokenizer.json over all 512 ids:
  <pad>=0, <s>=1 (bos), </s>=2 (eos), "w<i>" for the others."""
  # pylint: disable=import-outside-toplevel  # torch, transformers and tokenizers are the optional hf extra
  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  config = transformers.AutoConfig.for_model(
      "qwen3",
      vocab_size=512,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      tie_word_embeddings=True,
      initializer_range=0.2,
      bos_token_id=1,
      eos_token_id=2,
  )
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(config).eval()
  model.save_pretrained(str(folder))
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
  vocab.update({f"w{i}": i for i in range(3, 512)})
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
  tokenizer.save(str(folder / "tokenizer.json"))
  return model, tokenizer


def _hf_greedy(model, prompt, max_tokens):
  import torch  # pylint: disable=import-outside-toplevel  # optional hf extra

  tokens, out = list(prompt), []
  with torch.no_grad():
    for _ in range(max_tokens):
      out.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
      tokens.append(out[-1])
      if out[-1] == EOS:
        break
  return out


@pytest.mark.hf
@pytest.mark.slow
def test_hugging_face_folder_and_its_orbax_conversion_decode_like_transformers(tmp_path):
  hf_dir = tmp_path / "hf"
  model, tokenizer = _write_hf_folder(hf_dir)
  # A config-only copy (no weights, no tokenizer) and the Orbax conversion of the weights.
  config_only = tmp_path / "config_only"
  config_only.mkdir()
  shutil.copy(hf_dir / "config.json", config_only / "config.json")
  converted = convert(hf_dir, tmp_path / "converted", progress=False)
  common = ["configs/base.yml", "prompt=w10 w20 w30", "max_new_tokens=6", "output_format=json"]
  runs = _run_all(
      common + [f"hf_model_path={hf_dir}"],
      common
      + [
          f"hf_model_path={config_only}",
          f"tokenizer_path={hf_dir}",
          f"load_parameters_path={converted['load_parameters_path']}",
      ],
      ["configs/base.yml", f"hf_model_path={config_only}", "prompt_token_ids=[10, 20, 30]"],
  )
  request = _json_request(runs[0])
  # The tokenizer does not add bos itself; the CLI prepends config.json's bos_token_id.
  assert request["prompt_token_ids"] == [1] + tokenizer.encode("w10 w20 w30").ids == [1, 10, 20, 30]
  expected = _hf_greedy(model, request["prompt_token_ids"], 6)
  assert request["output_token_ids"] == expected
  _check_length(request, 6)
  assert request["text"] == tokenizer.decode(expected, skip_special_tokens=True) and request["text"]
  # The config-only folder has no safetensors: these tokens can only come from the Orbax checkpoint.
  assert _json_request(runs[1])["output_token_ids"] == expected
  # No tokenizer.json next to the model: the byte-level fallback is not used for a real model, even with ids.
  status, out, err = runs[2]
  assert status == 2 and out == ""
  assert len(err.splitlines()) == 1 and err.startswith(ERROR_PREFIX) and "has no tokenizer.json" in err, err


@pytest.mark.slow
def test_orbax_checkpoint_decodes_like_the_saved_model(tmp_path):
  cfg = load_config(model_name="llama-tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(123)))
  path = save_params(tmp_path / "params", model)
  prompt = [40, 41, 42, 43, 44]
  runs = _run_all(
      [
          "configs/base.yml",
          "model_name=llama-tiny",
          f"load_parameters_path={path}",
          f"prompt_token_ids={prompt}",
          "max_new_tokens=6",
          "output_format=json",
      ]
  )
  request = _json_request(runs[0])
  assert request["prompt_token_ids"] == prompt
  _check_length(request, 6)
  assert request["output_token_ids"] == _dense_greedy(model, prompt, 6)
  # The random weights of init_seed=0 would decode differently: the checkpoint was really read.
  random_init = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(cfg.init_seed)))
  assert request["output_token_ids"] != _dense_greedy(random_init, prompt, 6)
