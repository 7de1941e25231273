"""The vLLM plugin: registration through a fake tpu-inference model loader, errors without vLLM / tpu-inference.

tpu-inference cannot be imported here (it needs jax 0.11.2 and vLLM), so the tests inject a fake
`tpu_inference.models.common.model_loader` whose `register_model` records what it is given and applies the checks
tpu-inference 0.32.0's `register_model` applies before accepting a class (written here from those facts, see
docs/runner-contract.md): `__init__` takes `vllm_config` as a keyword; the class itself defines `__call__`, and it
takes `kv_caches`, `input_ids` and `attention_metadata` as keywords.
"""

import importlib
import inspect
import pathlib
import sys
import tomllib
import types
from unittest import mock

import pytest

from maxtext.integration.vllm import plugin
from maxtext.integration.vllm.adapter import MaxTextForCausalLM

_PYPROJECT = pathlib.Path(__file__).resolve().parents[4] / "pyproject.toml"
_REQUIRED_CALL_KEYWORDS = ("kv_caches", "input_ids", "attention_metadata")
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _accepts_keyword(fn, name: str) -> bool:
  """True when `fn(name=...)` binds: a parameter of that name passable by keyword, or a `**kwargs`."""
  params = inspect.signature(fn).parameters
  if name in params:
    return params[name].kind in _KEYWORD_KINDS
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_runner_interface(cls: type) -> None:
  """What tpu-inference requires of a model class before registering it (raises TypeError otherwise)."""
  if not _accepts_keyword(cls.__init__, "vllm_config"):
    raise TypeError(f"{cls.__name__}.__init__ must accept the keyword vllm_config")
  if not any("__call__" in vars(c) for c in cls.__mro__ if c is not object):
    raise TypeError(f"{cls.__name__} must define __call__")
  missing = [kw for kw in _REQUIRED_CALL_KEYWORDS if not _accepts_keyword(cls.__call__, kw)]
  if missing:
    raise TypeError(f"{cls.__name__}.__call__ must accept the keywords {missing}")


class _RecordingLoader(types.ModuleType):
  """A fake `tpu_inference.models.common.model_loader`: `register_model` checks the class and records it."""

  def __init__(self):
    super().__init__(plugin.MODEL_LOADER_MODULE)
    self.calls = []
    self.registry = {}

  def register_model(self, arch: str, model: type) -> None:
    """Checks `model` as tpu-inference does, then records it under `arch`."""
    check_runner_interface(model)
    self.calls.append((arch, model))
    self.registry[arch] = model


class _MambaModelConfig:
  """Records the configs vLLM's `MambaModelConfig.verify_and_update_config` would update (the upstream tier runs
  the real one)."""

  updated: list = []

  @classmethod
  def verify_and_update_config(cls, vllm_config) -> None:
    """Records the config it was given."""
    cls.updated.append(vllm_config)


def _fake_models_config() -> types.ModuleType:
  """A fake `vllm.model_executor.models.config` with an empty MODELS_CONFIG_MAP."""
  module = types.ModuleType(plugin.MODELS_CONFIG_MODULE)
  module.MODELS_CONFIG_MAP = {}
  module.MambaModelConfig = _MambaModelConfig
  return module


def _fake_modules(loader: types.ModuleType | None, models_config: types.ModuleType | None = None) -> dict:
  """sys.modules entries for vLLM and tpu-inference's package chain down to `loader`."""
  return {
      "vllm": types.ModuleType("vllm"),
      "vllm.model_executor": types.ModuleType("vllm.model_executor"),
      "vllm.model_executor.models": types.ModuleType("vllm.model_executor.models"),
      plugin.MODELS_CONFIG_MODULE: models_config or _fake_models_config(),
      "tpu_inference": types.ModuleType("tpu_inference"),
      "tpu_inference.models": types.ModuleType("tpu_inference.models"),
      "tpu_inference.models.common": types.ModuleType("tpu_inference.models.common"),
      plugin.MODEL_LOADER_MODULE: loader,
  }


def test_register_hands_the_class_to_tpu_inference_register_model():
  loader = _RecordingLoader()
  with mock.patch.dict(sys.modules, _fake_modules(loader)):
    plugin.register()
  assert loader.calls == [("MaxTextForCausalLM", MaxTextForCausalLM)]
  assert loader.registry["MaxTextForCausalLM"] is MaxTextForCausalLM


def test_register_twice_keeps_one_entry_with_the_class():
  loader = _RecordingLoader()
  with mock.patch.dict(sys.modules, _fake_modules(loader)):
    plugin.register()
    plugin.register()
  assert len(loader.calls) == 2
  assert loader.registry == {"MaxTextForCausalLM": MaxTextForCausalLM}


def test_the_model_class_passes_the_runner_interface_check():
  check_runner_interface(MaxTextForCausalLM)
  # The runner builds the class positionally as cls(vllm_config, rng, mesh).
  assert list(inspect.signature(MaxTextForCausalLM.__init__).parameters)[1:4] == ["vllm_config", "rng_key", "mesh"]


class _NoMetadata:

  def __init__(self, vllm_config):
    self.vllm_config = vllm_config

  def __call__(self, kv_caches, input_ids):
    return kv_caches, input_ids


class _NoCall:

  def __init__(self, vllm_config):
    self.vllm_config = vllm_config


class _PositionalOnlyConfig:

  def __init__(self, vllm_config, /):
    self.vllm_config = vllm_config

  def __call__(self, kv_caches, input_ids, attention_metadata):
    return kv_caches


@pytest.mark.parametrize(
    "cls, match",
    [
        (_NoMetadata, r"keywords \['attention_metadata'\]"),
        (_NoCall, "must define __call__"),
        (_PositionalOnlyConfig, "keyword vllm_config"),
    ],
)
def test_the_interface_check_rejects_what_the_runner_rejects(cls, match):
  loader = _RecordingLoader()
  with pytest.raises(TypeError, match=match):
    loader.register_model("Bad", cls)
  assert not loader.calls


@pytest.mark.parametrize(
    "missing, package",
    [
        ({"vllm": None}, "the vllm package"),
        ({"tpu_inference": None, plugin.MODEL_LOADER_MODULE: None}, "the tpu-inference package"),
    ],
)
def test_register_names_the_missing_package(missing, package):
  with mock.patch.dict(sys.modules, {**_fake_modules(_RecordingLoader()), **missing}):
    with pytest.raises(plugin.PluginEnvironmentError, match=f"needs {package}.*pip install vllm-tpu==0.32.0"):
      plugin.register()


def test_register_rejects_a_tpu_inference_without_register_model():
  with mock.patch.dict(sys.modules, _fake_modules(types.ModuleType(plugin.MODEL_LOADER_MODULE))):
    with pytest.raises(plugin.PluginEnvironmentError, match="has no callable register_model.*0.32.0"):
      plugin.register()


def test_pyproject_exposes_register_as_a_vllm_general_plugin():
  project = tomllib.loads(_PYPROJECT.read_text())["project"]
  entry = project["entry-points"]["vllm.general_plugins"]["maxtext"]
  module_name, attr = entry.split(":")
  assert getattr(importlib.import_module(module_name), attr) is plugin.register


def test_register_adds_the_config_hook_to_vllms_map():
  models_config = _fake_models_config()
  with mock.patch.dict(sys.modules, _fake_modules(_RecordingLoader(), models_config)):
    plugin.register()
  assert getattr(models_config, "MODELS_CONFIG_MAP") == {"MaxTextForCausalLM": plugin.MaxTextModelConfig}
  with mock.patch.dict(sys.modules, _fake_modules(_RecordingLoader(), types.ModuleType(plugin.MODELS_CONFIG_MODULE))):
    with pytest.raises(plugin.PluginEnvironmentError, match="has no MODELS_CONFIG_MAP dict"):
      plugin.register()


@pytest.mark.parametrize(
    "model_name, hybrid", [("qwen3-next-tiny", True), ("granite4-tiny", True), ("gemma3-tiny", False)]
)
def test_the_config_hook_gives_models_with_recurrent_layers_mambas_settings(model_name, hybrid):
  """vLLM's MambaModelConfig (align mode under prefix caching) for hybrid models only."""
  vllm_config = types.SimpleNamespace(additional_config={"maxtext_config": {"model_name": model_name}})
  _MambaModelConfig.updated.clear()
  with mock.patch.dict(sys.modules, _fake_modules(_RecordingLoader())):
    plugin.MaxTextModelConfig.verify_and_update_config(vllm_config)
  assert _MambaModelConfig.updated == ([vllm_config] if hybrid else [])
  plugin.MaxTextModelConfig.verify_and_update_model_config(object())  # vLLM calls both halves of a hook
