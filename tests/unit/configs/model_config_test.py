"""ModelConfig: the model's keys and derived values as one frozen, typed dataclass, each described once."""

import dataclasses

import pytest

from maxtext.configs import keys as config_keys
from maxtext.configs import load_config
from maxtext.configs.model_config import DERIVED, ModelConfig
from maxtext.models.transformer import Transformer
from maxtext.layers.initializers import ShapeOnlyRngs


def test_the_fields_are_the_model_keys_and_the_derived_values_and_no_run_key():
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  model_keys = {k.name for k in config_keys.KEYS.values() if k.category == config_keys.MODEL}
  assert names == model_keys | {k.name for k in DERIVED}
  for run_key in ("kernel_backend", "base_emb_dim", "use_qk_norm"):
    assert run_key in names  # the backend is the model's numerics' choice; the others are the model's
  for not_model in ("max_num_seqs", "block_size", "prompt", "cpu_weight_panels", "hf_model_path", "seed"):
    assert not_model not in names
  for field in dataclasses.fields(ModelConfig):
    assert field.metadata["key"].description, field.name
  assert ModelConfig.describe("sliding_window_size") == config_keys.KEYS["sliding_window_size"].description


def test_qwen3_tiny_as_its_yaml_and_its_family_say():
  cfg = ModelConfig.from_config(load_config(model_name="qwen3-tiny"))
  # configs/models/qwen3-tiny.yml: 4 layers of 64, 4 query and 2 KV heads of 32; Qwen3's family sets qk_norm.
  assert (cfg.base_emb_dim, cfg.base_num_decoder_layers, cfg.base_num_query_heads, cfg.base_num_kv_heads) == (
      64,
      4,
      4,
      2,
  )
  assert cfg.head_dim == 32 and cfg.attention_scale == 32**-0.5 and cfg.logits_via_embedding
  assert cfg.layer_types == ("full_attention",) * 4 and cfg.kv_shared_source == (-1,) * 4
  assert cfg.use_qk_norm and not cfg.use_sandwich_norm and cfg.moe_layers == (False,) * 4
  assert isinstance(cfg.logical_axis_rules, tuple) and all(isinstance(r, tuple) for r in cfg.logical_axis_rules)
  assert cfg["vocab_size"] == cfg.vocab_size and cfg.get("no_such_key", 3) == 3
  assert hash(cfg) == hash(ModelConfig.from_config(load_config(model_name="qwen3-tiny")))


def test_gemma3_tiny_derives_its_pattern_and_norms():
  cfg = ModelConfig.from_config(load_config(model_name="gemma3-tiny"))
  assert cfg.use_sandwich_norm and cfg.use_zero_centered_norm and cfg.use_embedding_scale
  assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types


def test_it_is_frozen_and_types_are_checked_naming_the_key():
  cfg = ModelConfig.from_config(load_config(model_name="llama-tiny"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.base_emb_dim = 3  # type: ignore[misc]
  loaded = dict(load_config(model_name="llama-tiny"))
  with pytest.raises(TypeError, match=r"ModelConfig.base_emb_dim must be int \(.*\), got '64'"):
    ModelConfig.from_config({**loaded, "base_emb_dim": "64"})
  with pytest.raises(TypeError, match=r"ModelConfig.use_qk_norm must be bool"):
    ModelConfig.from_config({**loaded, "use_qk_norm": 1})
  loaded.pop("rotary_dim")
  with pytest.raises(KeyError, match="ModelConfig needs 'rotary_dim'"):
    ModelConfig.from_config(loaded)
  assert ModelConfig.from_config(cfg) is cfg


def test_the_model_sees_only_the_model_config():
  model = Transformer(load_config(model_name="llama-tiny", max_num_seqs=3), rngs=ShapeOnlyRngs())
  assert isinstance(model.cfg, ModelConfig)
  assert not hasattr(model.cfg, "max_num_seqs")
