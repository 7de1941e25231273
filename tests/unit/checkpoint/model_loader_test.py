"""Tests of building a model from a config's checkpoint keys."""

import json

import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import hf, load_model, load_run_config, model_loader, save_params, source
from maxtext.configs import ConfigError, load_config
from maxtext import causal_lm
from maxtext.integration.vllm import adapter
from maxtext.models import Transformer, abstract_model, get_flat_params


def _assert_same(a, b):
  assert sorted(a) == sorted(b)
  for name, value in a.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(b[name]), err_msg=name)


def test_random_init_when_no_checkpoint_is_configured():
  cfg = load_config(model_name="llama-tiny", init_seed=3)
  _assert_same(get_flat_params(load_model(cfg)), get_flat_params(Transformer(cfg, rngs=nnx.Rngs(3))))


def test_orbax_checkpoint_wins(tmp_path):
  cfg = load_config(model_name="llama-tiny", init_seed=5)
  original = Transformer(cfg, rngs=nnx.Rngs(5))
  path = save_params(tmp_path / "ckpt", original)
  loaded = load_model(load_config(model_name="llama-tiny", load_parameters_path=path, hf_model_path="/not/used"))
  _assert_same(get_flat_params(loaded), get_flat_params(original))


def test_prompt_token_ids_are_checked_against_the_hf_folders_vocabulary(tmp_path):
  config = {
      "model_type": "llama",
      "vocab_size": 1000,
      "hidden_size": 64,
      "intermediate_size": 128,
      "num_hidden_layers": 2,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
  }
  (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
  assert load_config().vocab_size < 700  # id 700 is valid only with the folder's vocabulary
  cfg = load_run_config([f"hf_model_path={tmp_path}", "prompt_token_ids=[1, 700]"])
  assert cfg.vocab_size == 1000 and tuple(cfg.prompt_token_ids) == (1, 700)
  with pytest.raises(ConfigError, match=r"token 1000 must be in \[0, vocab_size=1000\)"):
    load_run_config([f"hf_model_path={tmp_path}", "prompt_token_ids=[1000]"])


@pytest.mark.hf
def test_hf_model_path(hf_checkpoint):
  folder, _ = hf_checkpoint("qwen3_tied")
  cfg = hf.load_hf_config(folder)
  _assert_same(get_flat_params(load_model(cfg, progress=False)), hf.load_hf_params(folder, cfg))


@pytest.mark.hf
def test_hf_model_path_fills_a_given_abstract_model_in_place(hf_checkpoint):
  folder, _ = hf_checkpoint("qwen3_tied")
  cfg = hf.load_hf_config(folder)
  into = abstract_model(cfg)
  loaded = load_model(cfg, progress=False, into=into)
  assert loaded is into
  _assert_same(get_flat_params(loaded), hf.load_hf_params(folder, cfg))


@pytest.mark.hf
@pytest.mark.parametrize("model_class", [causal_lm.CausalLM, adapter.MaxTextForCausalLM])
def test_the_runner_model_traces_its_model_once_when_loading_a_folder(hf_checkpoint, monkeypatch, model_class):
  """The model's constructor builds the abstract model; loading fills that one instead of tracing another."""

  folder, _ = hf_checkpoint("qwen3_tied")
  cfg = hf.load_hf_config(folder)
  calls = []

  def counted(c):
    calls.append(c)
    return abstract_model(c)

  monkeypatch.setattr(causal_lm, "abstract_model", counted)
  monkeypatch.setattr(source, "abstract_model", counted)
  model = model_class.from_config(cfg, None)
  model.load_weights(None)
  assert len(calls) == 1
  _assert_same(get_flat_params(model.model), hf.load_hf_params(folder, cfg))


def test_overrides_are_checked_against_the_checkpoints_model_not_base_yml(tmp_path):
  """base.yml's model has 2 layers; num_kv_shared_layers=2 is valid for the folder's 6-layer model."""
  (tmp_path / "config.json").write_text(
      '{"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 96, "intermediate_size": 192,'
      ' "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,'
      ' "sliding_window": 16, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",'
      ' "sliding_attention", "sliding_attention", "full_attention"]}'
  )
  cfg = model_loader.load_run_config(hf_model_path=str(tmp_path), num_kv_shared_layers=2)
  assert cfg.base_num_decoder_layers == 6 and cfg.kv_shared_source == (-1, -1, -1, -1, 3, 2)
  argv_cfg = model_loader.load_run_config([f"hf_model_path={tmp_path}", "num_kv_shared_layers=2"])
  assert argv_cfg.kv_shared_source == cfg.kv_shared_source
  with pytest.raises(ConfigError, match="num_kv_shared_layers=6: must be < base_num_decoder_layers=6"):
    model_loader.load_run_config(hf_model_path=str(tmp_path), num_kv_shared_layers=6)
