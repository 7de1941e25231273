"""Tests of configuration loading: layering, strict typing, unknown and duplicate keys."""

import os
import shutil

import pytest

from maxtext.configs import BASE_CONFIG_PATH, ConfigError, available_models, config_to_dict, load_config
from maxtext.configs import loader
from maxtext.configs.schema import coerce_value, key_types, parse_command_line_value


@pytest.fixture(name="config_dir")
def fixture_config_dir(tmp_path):
  """A private copy of base.yml with a models/ folder holding one model."""
  shutil.copy(BASE_CONFIG_PATH, tmp_path / "base.yml")
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "toy.yml").write_text(
      "decoder_block: qwen3\nbase_emb_dim: 32\nbase_num_decoder_layers: 3\nhead_dim: 8\n", encoding="utf-8"
  )
  return tmp_path


def _as_tuples(value):
  """Lists, nested ones included, as the tuples a loaded config holds."""
  return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def test_defaults_load_and_every_key_is_present():
  cfg = load_config()
  raw = loader.read_yaml(BASE_CONFIG_PATH)
  for key, value in raw.items():
    got = getattr(cfg, key)
    assert got == _as_tuples(value) or key == "layer_types"
  assert cfg.layer_types == ("full_attention",) * raw["base_num_decoder_layers"]


def test_layering_base_then_model_then_overrides(config_dir):
  base = str(config_dir / "base.yml")
  cfg = load_config([base, "model_name=toy", "head_dim=4"], base_emb_dim=48)
  assert cfg.decoder_block == "qwen3"  # from the model file
  assert cfg.base_num_decoder_layers == 3  # from the model file
  assert cfg.head_dim == 4  # command line beats the model file
  assert cfg.base_emb_dim == 48  # keyword beats the model file
  assert cfg.vocab_size == loader.read_yaml(BASE_CONFIG_PATH)["vocab_size"]  # base default


def test_config_is_frozen_and_hashable():
  cfg = load_config(base_emb_dim=32)
  with pytest.raises((AttributeError, ValueError)):
    cfg.base_emb_dim = 64  # pylint: disable=attribute-defined-outside-init  # the point is that it must fail
  assert hash(cfg) == hash(load_config(base_emb_dim=32))
  assert hash(cfg) != hash(load_config(base_emb_dim=48))


def test_unknown_key_suggests_closest():
  with pytest.raises(
      ConfigError, match=r"unknown config key 'base_emb_dm' \(keyword argument\) \(did you mean 'base_emb_dim'\?\)"
  ):
    load_config(base_emb_dm=3)
  with pytest.raises(ConfigError, match=r"unknown config key 'vocab' \(command line\)"):
    load_config(["vocab=3"])


def test_unknown_key_in_model_file(config_dir):
  (config_dir / "models" / "bad.yml").write_text("base_emb_dims: 3\n", encoding="utf-8")
  with pytest.raises(
      ConfigError, match=r"unknown config key 'base_emb_dims' \(.*bad.yml\) \(did you mean 'base_emb_dim'\?\)"
  ):
    load_config([str(config_dir / "base.yml"), "model_name=bad"])


def test_key_set_twice_in_one_yaml_file(config_dir):
  (config_dir / "models" / "dup.yml").write_text("head_dim: 8\nvocab_size: 10\nhead_dim: 16\n", encoding="utf-8")
  with pytest.raises(ConfigError, match=r"key 'head_dim' is set twice \(lines 1 and 3\)"):
    load_config([str(config_dir / "base.yml"), "model_name=dup"])


def test_key_set_twice_on_command_line_or_in_both_override_forms():
  with pytest.raises(ConfigError, match=r"head_dim is set twice on the command line \('8' and '16'\)"):
    load_config(["head_dim=8", "head_dim=16"])
  with pytest.raises(ConfigError, match="head_dim set both on the command line and as a keyword argument"):
    load_config(["head_dim=8"], head_dim=16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"head_dim": 8.0}, r"head_dim=8.0 \(keyword argument\): must be an integer, got float"),
        ({"head_dim": True}, r"head_dim=True \(keyword argument\): must be an integer, got bool"),
        ({"logits_via_embedding": 1}, r"logits_via_embedding=1 \(keyword argument\): must be a bool"),
        ({"rope_max_timescale": "big"}, r"rope_max_timescale='big' \(keyword argument\): must be a number, got str"),
        ({"rope_max_timescale": False}, r"must be a number, got bool"),
        ({"dtype": 32}, r"dtype=32 \(keyword argument\): must be a string, got int"),
        ({"mlp_only_layers": 3}, r"mlp_only_layers=3 \(keyword argument\): must be a list, got int"),
        ({"mlp_only_layers": [1, "2"]}, r"element 1 must be int, got '2'"),
        ({"prompt_token_ids": [True]}, r"element 0 must be int, got True"),
    ],
)
def test_wrong_types_are_rejected(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    load_config(**kwargs)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("head_dim=eight", r"head_dim='eight' \(command line\): must be an integer"),
        ("head_dim=8.5", r"must be an integer"),
        ("rope_max_timescale=x", r"must be a number"),
        ("logits_via_embedding=maybe", r"must be a bool \(true or false\)"),
        ("mlp_only_layers=[1, oops", r"not a valid list"),
        ("mlp_only_layers=1,x", r"element 'x' must be an integer"),
        ("head_dim", r"argument 'head_dim' must be key=value"),
    ],
)
def test_bad_command_line_values(arg, message):
  with pytest.raises(ConfigError, match=message):
    load_config(["base.yml", arg])


def test_command_line_parsing_of_each_type():
  cfg = load_config(
      [
          "rope_max_timescale=1e6",
          "head_dim=32",
          "logits_via_embedding=true",
          "mlp_only_layers=0,1",
          "prompt_token_ids=[5, 6]",
          "prompt=yes no",
          "layer_types=",
          "attention_bias=False",
      ]
  )
  assert cfg.rope_max_timescale == 1e6 and isinstance(cfg.rope_max_timescale, float)
  assert cfg.head_dim == 32 and cfg.logits_via_embedding is True and cfg.attention_bias is False
  assert cfg.mlp_only_layers == (0, 1) and cfg.prompt_token_ids == (5, 6)
  assert cfg.prompt == "yes no"


def test_int_is_widened_to_float():
  cfg = load_config(rope_max_timescale=500000)
  assert cfg.rope_max_timescale == 500000.0 and isinstance(cfg.rope_max_timescale, float)


def test_unknown_model_suggests_closest(config_dir):
  with pytest.raises(ConfigError, match=r"model_name='tay': no configs/models/tay.yml \(did you mean 'toy'\?\)"):
    load_config([str(config_dir / "base.yml"), "model_name=tay"])


def test_model_file_disagreeing_model_name(config_dir):
  (config_dir / "models" / "named.yml").write_text("model_name: other\n", encoding="utf-8")
  with pytest.raises(ConfigError, match="disagrees with the file name"):
    load_config([str(config_dir / "base.yml"), "model_name=named"])


def test_base_path_resolution_and_errors(config_dir, tmp_path):
  # A bare file name falls back to the package's base.yml.
  assert load_config(["base.yml", "head_dim=8"]).head_dim == 8
  with pytest.raises(ConfigError, match="must be a config YAML path or a key=value override"):
    load_config(["configs/base.txt"])
  with pytest.raises(ConfigError, match="does not exist"):
    load_config([str(tmp_path / "nothere" / "base.yml")])
  with pytest.raises(ConfigError, match="must be a sequence of strings"):
    load_config("model_name=x")
  partial = config_dir / "partial.yml"
  partial.write_text("head_dim: 8\n", encoding="utf-8")
  with pytest.raises(ConfigError, match="must set every key; missing"):
    load_config([str(partial)])


def test_read_yaml_errors(tmp_path):
  bad = tmp_path / "bad.yml"
  bad.write_text("a: [1, 2\n", encoding="utf-8")
  with pytest.raises(ConfigError, match="not valid YAML"):
    loader.read_yaml(str(bad))
  seq = tmp_path / "seq.yml"
  seq.write_text("- 1\n- 2\n", encoding="utf-8")
  with pytest.raises(ConfigError, match="must be a mapping of key: value, got list"):
    loader.read_yaml(str(seq))
  empty = tmp_path / "empty.yml"
  empty.write_text("", encoding="utf-8")
  assert not loader.read_yaml(str(empty))


def test_available_models(config_dir):
  assert available_models(str(config_dir / "base.yml")) == ["toy"]
  assert not available_models(str(config_dir / "models" / "toy.yml"))
  assert set(available_models()) == {
      n[:-4] for n in os.listdir(os.path.join(os.path.dirname(BASE_CONFIG_PATH), "models")) if n.endswith(".yml")
  }


def test_config_to_dict_round_trips_through_load_config():
  cfg = load_config(mlp_only_layers=[1], base_num_decoder_layers=3)
  plain = config_to_dict(cfg)
  assert plain["mlp_only_layers"] == [1]
  base_keys = set(loader.read_yaml(BASE_CONFIG_PATH))
  again = load_config(**{k: v for k, v in plain.items() if k in base_keys})
  assert again == cfg


def test_schema_helpers_reject_unsupported_defaults():
  with pytest.raises(ConfigError, match="must default to a bool, int, float, str or list"):
    key_types({"x": None})
  with pytest.raises(ConfigError, match="has no element type"):
    key_types({"new_list": []})
  assert coerce_value("layer_types", ["full_attention"], list, "test") == ("full_attention",)
  assert parse_command_line_value("layer_types", "full_attention, sliding_attention", list) == (
      "full_attention",
      "sliding_attention",
  )
  assert parse_command_line_value("logits_via_embedding", "0", bool) is False


def test_a_yaml_with_base_config_holds_only_its_changes(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "mid.yml").write_text("base_config: base.yml\nseed: 7\nmax_target_length: 96\n", encoding="utf-8")
  (tmp_path / "sub" / "top.yml").write_text("base_config: ../mid.yml\nseed: 9\n", encoding="utf-8")
  cfg = load_config([str(tmp_path / "sub" / "top.yml"), "num_kv_blocks=16"])
  assert (cfg.seed, cfg.max_target_length, cfg.num_kv_blocks) == (9, 96, 16)
  plain = load_config()
  assert cfg.base_num_decoder_layers == plain.base_num_decoder_layers  # the rest comes from the package's base.yml


@pytest.mark.parametrize(
    "text, match",
    [
        ("base_config: 3\n", r"base_config must name a .yml file, got 3"),
        ("base_config: other.txt\n", r"base_config must name a .yml file, got 'other.txt'"),
        ("base_config: missing.yml\n", r"config file '.*missing.yml' does not exist"),
        ("base_config: loop.yml\n", r"base_config='loop.yml' makes a cycle \(.*loop.yml -> .*loop.yml\)"),
    ],
)
def test_base_config_errors_name_the_file(tmp_path, text, match):
  path = tmp_path / "loop.yml"
  path.write_text(text, encoding="utf-8")
  with pytest.raises(ConfigError, match=match):
    load_config([str(path)])


def test_merge_layers_with_origins_names_the_layer_of_each_key():
  values, origins = loader.merge_layers_with_origins(
      [BASE_CONFIG_PATH, "model_name=smollm2-135m-instruct", "prompt=Hi"], seed=3
  )
  assert values == loader.merge_layers([BASE_CONFIG_PATH, "model_name=smollm2-135m-instruct", "prompt=Hi"], seed=3)
  assert origins["gguf_model_path"] == "model_name=smollm2-135m-instruct"
  assert origins["prompt"] == origins["model_name"] == "the command line"
  assert origins["seed"] == "a keyword argument"
  assert origins["block_size"] == BASE_CONFIG_PATH
