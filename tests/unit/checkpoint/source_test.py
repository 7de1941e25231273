"""The checkpoint source interface: which config key names which source, what each supplies, and the errors for
none, two, or an unknown key. GGUF files are covered in gguf_test.py, beside the writer of tiny GGUF files."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import hf, save_params, source
from maxtext.checkpoint.hf_config import hf_config_to_overrides, read_hf_config
from maxtext.configs import ConfigError, load_config
from maxtext.models import Transformer, get_flat_params


def _keys(**values):
  return {"load_parameters_path": "", "hf_model_path": "", "gguf_model_path": "", **values}


@pytest.mark.parametrize(
    "key, cls",
    [
        ("hf_model_path", source.HFFolder),
        ("gguf_model_path", source.GGUFFile),
        ("load_parameters_path", source.OrbaxFolder),
    ],
)
def test_each_key_opens_its_source(key, cls):
  opened = source.open_source(key, "/some/path")
  assert isinstance(opened, cls) and opened.key == key and opened.path == "/some/path"
  assert repr(opened) == f"{cls.__name__}({key}='/some/path')"


def test_open_source_rejects_unknown_keys_and_bad_paths():
  with pytest.raises(ValueError, match="'tokenizer_path' names no checkpoint source; the source keys are load_param"):
    source.open_source("tokenizer_path", "/x")
  with pytest.raises(ValueError, match="hf_model_path is empty"):
    source.open_source("hf_model_path", "")
  with pytest.raises(TypeError, match="gguf_model_path must be a path, got int"):
    source.open_source("gguf_model_path", 3)


def test_the_config_keys_are_read_once_into_sources():
  assert not source.names_checkpoint(_keys())
  assert source.model_source(_keys()) is None and source.weights_source(_keys()) is None
  keys = _keys(load_parameters_path="/ckpt", gguf_model_path="/m.gguf")
  assert source.names_checkpoint(keys)
  assert list(source.configured_sources(keys)) == ["load_parameters_path", "gguf_model_path"]
  assert isinstance(source.model_source(keys), source.GGUFFile)
  # A converted checkpoint: the Orbax copy supplies the tensors, the GGUF file the model keys and tokenizer.
  assert isinstance(source.weights_source(keys), source.OrbaxFolder)
  assert isinstance(source.weights_source(_keys(hf_model_path="/hf")), source.HFFolder)
  cfg = load_config(hf_model_path="/hf")  # a built config is read by attribute
  assert isinstance(source.model_source(cfg), source.HFFolder)


def test_two_model_sources_are_one_clear_error():
  keys = _keys(hf_model_path="/hf", gguf_model_path="/m.gguf")
  for ask in (source.model_source, source.weights_source):
    with pytest.raises(ConfigError, match="hf_model_path='/hf' and gguf_model_path='/m.gguf' are both set; set one"):
      ask(keys)


def test_two_model_sources_name_the_layer_that_set_each():
  keys = _keys(hf_model_path="/hf", gguf_model_path="/m.gguf")
  origins = {"hf_model_path": "the command line", "gguf_model_path": "model_name=smollm2-135m-instruct"}
  with pytest.raises(ConfigError) as raised:
    source.model_source(keys, origins)
  assert str(raised.value) == (
      "the command line sets hf_model_path='/hf' and model_name=smollm2-135m-instruct sets gguf_model_path='/m.gguf';"
      " a run takes its model from one source: drop model_name=smollm2-135m-instruct (its model config names"
      " gguf_model_path) or hf_model_path"
  )
  both_typed = dict.fromkeys(origins, "the command line")
  with pytest.raises(ConfigError, match=r"^the command line sets hf_model_path='/hf' and gguf_model_path='/m.gguf';"):
    source.model_source(keys, both_typed)


def test_a_file_given_as_the_hugging_face_folder_is_named_a_file(tmp_path):
  path = tmp_path / "model.safetensors"
  path.write_bytes(b"\x00" * 8)
  folder = source.open_source("hf_model_path", str(path))
  for ask in (folder.load_config, folder.model_keys):
    with pytest.raises(ConfigError, match=r"hf_model_path='.*model.safetensors' is a file, not a folder"):
      ask()
  with pytest.raises(ValueError, match=r"hf_model_path='.*model.safetensors' is a file, not a folder"):
    next(iter(folder.iter_params(load_config())))


@pytest.mark.parametrize(
    "paths, message",
    [
        ({"hf_model_path": None, "gguf_model_path": None}, "give exactly one of hf_model_path and gguf_model_path to x"),
        ({"hf_model_path": "/a", "gguf_model_path": "/b"}, "give exactly one of hf_model_path and gguf_model_path to x"),
        ({"load_parameters_path": "/a"}, "'load_parameters_path' is no model source"),
    ],
)
def test_exactly_one_model_source(paths, message):
  with pytest.raises(ValueError, match=message):
    source.exactly_one_model_source(paths, "x")


def test_exactly_one_model_source_opens_the_given_one():
  opened = source.exactly_one_model_source({"hf_model_path": None, "gguf_model_path": "/m.gguf"}, "x")
  assert isinstance(opened, source.GGUFFile) and opened.path == "/m.gguf"


def test_orbax_folder_supplies_tensors_only(tmp_path):
  cfg = load_config(model_name="llama-tiny", init_seed=2)
  model = Transformer(cfg, rngs=nnx.Rngs(2))
  path = save_params(tmp_path / "ckpt", model)
  orbax_folder = source.open_source("load_parameters_path", path)
  assert not orbax_folder.supplies_model_keys and orbax_folder.model_keys() == {}
  assert orbax_folder.tokenizer() is None and orbax_folder.chat_template() is None
  assert orbax_folder.tokenizer_keys() == {}
  with pytest.raises(
      NotImplementedError, match="load_parameters_path: an Orbax folder holds tensors only, no model keys"
  ):
    orbax_folder.load_config()
  expected = get_flat_params(model)
  restored = dict(orbax_folder.iter_params(cfg))
  assert sorted(restored) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value), err_msg=name)
  loaded = get_flat_params(orbax_folder.load_model(cfg))
  np.testing.assert_array_equal(np.asarray(loaded["embedder.embedding"]), np.asarray(expected["embedder.embedding"]))


@pytest.mark.hf
def test_hf_folder_supplies_model_keys_tensors_and_tokenizer_files(hf_checkpoint):
  folder, _ = hf_checkpoint("qwen3_tied")
  hf_folder = source.open_source("hf_model_path", str(folder))
  assert hf_folder.model_keys() == hf_config_to_overrides(read_hf_config(folder))
  cfg = hf_folder.load_config(weight_dtype="float32")
  assert cfg.hf_model_path == str(folder) and cfg.decoder_block == "qwen3"
  expected = hf.load_hf_params(folder, cfg)
  streamed = dict(hf_folder.iter_params(cfg))
  assert sorted(streamed) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(streamed[name], value, err_msg=name)
  assert hf_folder.tokenizer() == source.TokenizerFiles(str(folder))
  assert hf_folder.tokenizer_keys() == {"tokenizer_path": str(folder)}


def test_hf_folder_run_config_rules(tmp_path):
  file = tmp_path / "config.json"
  file.write_text("{}", encoding="utf-8")
  with pytest.raises(ConfigError, match="is a file, not a folder"):
    source.HFFolder(str(file)).check_run_config({"model_name": "default"})
  with pytest.raises(ConfigError, match="and model_name='llama-tiny' both name the model"):
    source.HFFolder(str(tmp_path)).check_run_config({"model_name": "llama-tiny"})
  source.HFFolder(str(tmp_path)).check_run_config({"model_name": "default"})  # a folder without model_name is fine


@pytest.mark.parametrize(
    "files, expected",
    [
        ({}, None),
        ({"tokenizer_config.json": {"chat_template": "{{ 1 }}"}}, "{{ 1 }}"),
        ({"tokenizer_config.json": {"chat_template": [{"name": "default", "template": "D"}]}}, "D"),
        ({"tokenizer_config.json": {"chat_template": "{{ 1 }}"}, "chat_template.jinja": "{{ 2 }}"}, "{{ 2 }}"),
        ({"tokenizer_config.json": ["not", "an", "object"]}, None),
    ],
)
def test_hf_folder_chat_template(tmp_path, files, expected):
  for name, content in files.items():
    text = content if isinstance(content, str) else json.dumps(content)
    (tmp_path / name).write_text(text, encoding="utf-8")
  assert source.HFFolder(str(tmp_path)).chat_template() == expected


def test_a_broken_tokenizer_config_is_named(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text("{", encoding="utf-8")
  with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
    source.folder_chat_template(str(tmp_path))


_CLI_IMPORTS = """
import json, sys
import maxtext.decode_run
before = "orbax.checkpoint" in sys.modules
from maxtext.checkpoint import save_params  # the package's Orbax names still resolve, importing Orbax then
print(json.dumps({"before": before, "after": "orbax.checkpoint" in sys.modules, "module": save_params.__module__}))
"""


@pytest.mark.slow  # a fresh interpreter imports JAX
def test_the_cli_imports_orbax_only_when_a_run_asks_for_it():
  src = str(pathlib.Path(__file__).resolve().parents[3] / "src")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-c", _CLI_IMPORTS], capture_output=True, text=True, env=env, check=False)
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout) == {"before": False, "after": True, "module": "maxtext.checkpoint.orbax"}
