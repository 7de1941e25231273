"""The key declarations (configs/keys.py) against base.yml and the modules that read a key's category."""

import pytest

from maxtext.checkpoint import weight_cache
from maxtext.configs import ConfigError, keys, run_options
from maxtext.configs.loader import BASE_CONFIG_PATH, base_key_types, load_config
from maxtext.configs.schema import LIST_ELEMENT_TYPES
from maxtext.inference import step_programs


def _declared_names_in_source_order():
  return [k.name for k in keys._DECLARED]  # pylint: disable=protected-access


def test_every_base_key_is_declared_once_with_its_type_and_a_description():
  declared = _declared_names_in_source_order()
  assert len(declared) == len(set(declared)), "a key is declared twice"
  types = base_key_types()
  assert set(declared) == set(types), "base.yml and configs/keys.py list different keys"
  for name, key in keys.KEYS.items():
    assert key.type is types[name], f"{name}: declared {key.type.__name__}, base.yml has {types[name].__name__}"
    assert key.category in keys.CATEGORIES, name
    assert key.description.strip() and "\n" not in key.description, name
    assert (key.element is not None) == (key.type is list), name


def test_base_yml_lists_the_keys_in_the_declared_order():
  with open(BASE_CONFIG_PATH, encoding="utf-8") as f:
    in_file = [line.split(":", 1)[0] for line in f if line[:1].isalpha()]
  assert in_file == _declared_names_in_source_order()


def test_the_readers_take_the_categories_from_the_declarations():
  assert set(run_options.RUN_OPTION_KEYS) == keys.names(keys.CLI, keys.RUNNER)
  assert set(run_options.CLI_KEYS) == keys.names(keys.CLI)
  assert set(run_options.RUNNER_KEYS) == keys.names(keys.RUNNER)
  # The runtime keys, and the one derived value computed from them (the state block size of the runner's caches).
  assert weight_cache.RUNTIME_KEYS == keys.names(keys.RUNTIME) | {"state_block_size"}
  assert dict(LIST_ELEMENT_TYPES) == {k.name: k.element for k in keys.KEYS.values() if k.type is list}


class _Backend:
  """A backend with no options."""

  name = "cpu"


def _weight_key(cfg):
  model_keys = run_options.model_config(cfg).to_dict()
  return weight_cache.cache_key(model_keys, ("gguf_model_path", "digest"), {"name": "cpu"}, "tree", [])


def _program_key(cfg):
  return step_programs.run_key(cfg, _Backend(), (), {"layer.0": 0})


def test_a_run_option_changes_neither_key_a_runtime_key_only_the_programs_and_a_model_key_both():
  base = load_config(model_name="llama-tiny")
  run = load_config(model_name="llama-tiny", prompt="x", max_new_tokens=3, weight_cache=False)
  runtime = load_config(model_name="llama-tiny", max_num_seqs=3)
  model = load_config(model_name="llama-tiny", weight_dtype="bfloat16")
  assert _weight_key(run) == _weight_key(base) and _program_key(run) == _program_key(base)
  assert _weight_key(runtime) == _weight_key(base) and _program_key(runtime) != _program_key(base)
  assert _weight_key(model) != _weight_key(base) and _program_key(model) != _program_key(base)


def test_bounds_and_choices_are_declared_on_keys_of_the_right_type_and_hold_for_the_defaults():
  types = base_key_types()
  for key in keys.KEYS.values():
    if key.bound is not None:
      assert key.bound in (keys.POSITIVE, keys.NON_NEGATIVE) and types[key.name] in (int, float), key.name
    if key.choices is not None:
      assert types[key.name] is str, key.name
  load_config()  # the defaults pass every declared check


def test_a_declared_bound_or_choice_error_names_the_key_the_bound_and_the_value():
  with pytest.raises(ConfigError, match=r"^block_size=0: must be > 0$"):
    load_config(block_size=0)
  with pytest.raises(ConfigError, match=r"^logprobs=-1: must be >= 0$"):
    load_config(logprobs=-1)
  with pytest.raises(ConfigError, match=r"^kv_cache_layout='x': must be one of layer, hybrid, shuffled$"):
    load_config(kv_cache_layout="x")
