"""The split of a loaded config into the model's keys and the run options."""

import ml_collections
import pytest

from maxtext.configs import ConfigError, load_config
from maxtext.configs.loader import base_key_types
from maxtext.configs.run_options import (
    CLI_KEYS,
    RUN_OPTION_KEYS,
    RUNNER_KEYS,
    model_config,
    reject_run_options,
)


def test_every_run_option_is_a_base_yml_key_and_the_two_kinds_do_not_overlap():
  assert set(RUN_OPTION_KEYS) <= set(base_key_types())
  assert not set(CLI_KEYS) & set(RUNNER_KEYS)
  # The keys the model is built from stay: its shape, source, numerics, backend, and the runner's cache keys.
  for key in ("model_name", "hf_model_path", "dtype", "kernel_backend", "block_size", "max_num_seqs", "init_seed"):
    assert key not in RUN_OPTION_KEYS


def test_model_config_drops_the_run_options_and_keeps_every_other_value():
  cfg = load_config(model_name="qwen3.5-tiny", prompt="hi", max_new_tokens=5, cpu_weight_panels=False, block_size=8)
  model = model_config(cfg)
  assert isinstance(model, ml_collections.FrozenConfigDict)
  assert set(model.keys()) == set(cfg.keys()) - set(RUN_OPTION_KEYS)
  assert "prompt" not in model and "max_new_tokens" not in model and "cpu_weight_panels" not in model
  assert all(cfg[key] == value for key, value in model.items())  # derived values too (layer_types, ...)
  assert model.block_size == 8 and model.layer_types == cfg.layer_types
  assert model_config(model) == model  # a model config is its own model config
  hash(model)  # still usable as a static argument


def test_model_config_needs_a_built_config():
  with pytest.raises(TypeError, match="model_config takes a config built by load_config, got dict"):
    model_config({"model_name": "llama-tiny"})


def test_reject_run_options_names_them_and_where():
  reject_run_options(["model_name", "block_size"], "here")  # model keys pass
  with pytest.raises(ConfigError, match=r"^somewhere sets output_format, seed: options of a maxtext-decode run"):
    reject_run_options(["seed", "dtype", "output_format"], "somewhere")
