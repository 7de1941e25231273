"""Loading a configuration MaxText style: base YAML, then the model YAML, then `key=value` overrides."""

from __future__ import annotations

import functools
import logging
import os
from types import MappingProxyType
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import yaml

from maxtext.configs import derived
from maxtext.configs.errors import ConfigError
from maxtext.configs.schema import coerce_value, key_types, parse_command_line_value, suggest_key

logger = logging.getLogger(__name__)

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
BASE_CONFIG_PATH = os.path.join(CONFIG_DIR, "base.yml")
DEFAULT_MODEL_NAME = "default"


class _StrictLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors  # PyYAML's loader hierarchy
  """A YAML loader that rejects a key set twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
  seen = {}
  for key_node, _ in node.value:
    key = loader.construct_object(key_node, deep=deep)
    if key in seen:
      raise ConfigError(
          f"{loader.name}: key {key!r} is set twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1});"
          " set each key once per file"
      )
    seen[key] = key_node.start_mark.line
  return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> dict[str, Any]:
  """Reads a YAML mapping, rejecting duplicate keys.

  Raises:
    ConfigError: the file is missing, is not UTF-8 text, is not valid YAML, or is not a mapping.
  """
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
  loader = None
  try:
    loader = _StrictLoader(text)  # its reader already rejects non-printable characters
    loader.name = path
    data = loader.get_single_data()
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
  finally:
    if loader is not None:
      loader.dispose()
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: must be a mapping of key: value, got {type(data).__name__}")
  return data


@functools.cache
def base_key_types() -> Mapping[str, type]:
  """Type of every configuration key, from the package's base.yml (read once per process)."""
  return MappingProxyType(key_types(read_yaml(BASE_CONFIG_PATH)))


def available_models(base_path: str = BASE_CONFIG_PATH) -> list[str]:
  """Returns the names of the model YAMLs in the `models/` folder beside the base config."""
  models_dir = os.path.join(os.path.dirname(base_path), "models")
  if not os.path.isdir(models_dir):
    return []
  return sorted(name[: -len(".yml")] for name in os.listdir(models_dir) if name.endswith(".yml"))


def _resolve_yaml(name: str, beside: str) -> str:
  """A config YAML named in another: a path relative to the naming file's folder, or a bare file name shipped with
  the package (as on the command line)."""
  path = os.path.join(os.path.dirname(beside), os.path.expanduser(name))
  if not os.path.isfile(path) and os.path.dirname(name) == "":
    path = os.path.join(CONFIG_DIR, name)
  return path


def read_config_yaml(path: str) -> dict[str, Any]:
  """A config YAML with its `base_config` chain resolved: as in MaxText, a file that sets `base_config: base.yml`
  holds only the keys it changes, laid over that file's (which may name its own base).

  Raises:
    ConfigError: as `read_yaml`, or a `base_config` that is not a YAML file name or that names a file of the chain
      again.
  """
  chain = [path]
  layers = [read_yaml(path)]
  while "base_config" in layers[-1]:
    name = layers[-1].pop("base_config")
    if not isinstance(name, str) or not name.endswith((".yml", ".yaml")):
      raise ConfigError(f"{chain[-1]}: base_config must name a .yml file, got {name!r}")
    parent = _resolve_yaml(name, chain[-1])
    if os.path.realpath(parent) in {os.path.realpath(p) for p in chain}:
      raise ConfigError(f"{chain[-1]}: base_config={name!r} makes a cycle ({' -> '.join(chain + [parent])})")
    chain.append(parent)
    layers.append(read_yaml(parent))
  values: dict[str, Any] = {}
  for layer in reversed(layers):
    values.update(layer)
  return values


def _model_config_path(model_name: str, base_path: str) -> str:
  for directory in (os.path.dirname(base_path), CONFIG_DIR):
    path = os.path.join(directory, "models", f"{model_name}.yml")
    if os.path.isfile(path):
      return path
  known = sorted(set(available_models(base_path)) | set(available_models()))
  raise ConfigError(
      f"model_name={model_name!r}: no configs/models/{model_name}.yml{suggest_key(model_name, known)};"
      f" known models: {', '.join(known)}"
  )


# Keys this package no longer reads, with what replaced them (an unknown-key error would only suggest a neighbour).
RETIRED_KEYS = {
    "cpu_small_matmul": (
        "the CPU kernels are the kernel backend `cpu` now: set kernel_backend=cpu (the engine's default on one CPU"
        " device) to use them, or kernel_backend=reference to run without them"
    ),
}


def _typed_layer(
    values: Mapping[str, Any], types: Mapping[str, type], source: str, is_text: bool = False
) -> dict[str, Any]:
  layer = {}
  for key, value in values.items():
    if key in RETIRED_KEYS:
      raise ConfigError(f"config key {key!r} ({source}) was removed: {RETIRED_KEYS[key]}")
    if not isinstance(key, str) or key not in types:
      raise ConfigError(f"unknown config key {key!r} ({source}){suggest_key(str(key), list(types))}")
    if is_text:
      value = parse_command_line_value(key, value, types[key])
    layer[key] = coerce_value(key, value, types[key], source)
  return layer


def _parse_argv(argv: Sequence[str]) -> tuple[str, dict[str, str]]:
  """Splits MaxText-style argv into (base YAML path, {key: text}); rejects a key given twice."""
  args = list(argv)
  base_path = BASE_CONFIG_PATH
  if args and "=" not in args[0]:
    base_path = args.pop(0)
    if not base_path.endswith((".yml", ".yaml")):
      raise ConfigError(f"{base_path!r}: the first argument must be a config YAML path or a key=value override")
    # A bare file name (no folder) that is not in the working directory names a YAML shipped with the package.
    if not os.path.isfile(base_path) and os.path.dirname(base_path) == "":
      base_path = os.path.join(CONFIG_DIR, base_path)
  overrides: dict[str, str] = {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument {arg!r} must be key=value")
    key, value = arg.split("=", 1)
    key = key.strip()
    if key in overrides:
      raise ConfigError(f"{key} is set twice on the command line ({overrides[key]!r} and {value!r})")
    overrides[key] = value
  return base_path, overrides


def merge_layers(argv: Sequence[str] = (), **overrides: Any) -> dict[str, Any]:
  """The values of `load_config`'s layers (base YAML, model YAML, overrides), each key's type checked, before the
  keys are validated together and derived values are added.

  Raises:
    ConfigError: an unknown key, a key set twice in one layer, or a value of the wrong type.
  """
  return merge_layers_with_origins(argv, **overrides)[0]


def merge_layers_with_origins(argv: Sequence[str] = (), **overrides: Any) -> tuple[dict[str, Any], dict[str, str]]:
  """`merge_layers`' values, and for each key the layer that set it, as an error message names it: `the command
  line`, `a keyword argument`, `model_name=NAME` (its models/NAME.yml) or the base YAML's path.

  Raises:
    ConfigError: see `merge_layers`.
  """
  if isinstance(argv, str):
    raise ConfigError(f"argv must be a sequence of strings, got the string {argv!r}")
  base_path, cli_text = _parse_argv(argv)
  base = read_config_yaml(base_path)
  types = base_key_types()
  values = _typed_layer(base, types, base_path)
  missing = sorted(set(types) - set(values))
  if missing:
    raise ConfigError(f"{base_path}: must set every key; missing {', '.join(missing)}")

  both = sorted(set(cli_text) & set(overrides))
  if both:
    raise ConfigError(f"{', '.join(both)} set both on the command line and as a keyword argument; set it once")
  override_layer = _typed_layer(cli_text, types, "command line", is_text=True)
  override_layer.update(_typed_layer(overrides, types, "keyword argument"))

  origins = dict.fromkeys(values, base_path)
  model_name = override_layer.get("model_name", values["model_name"])
  if model_name != DEFAULT_MODEL_NAME:
    model_path = _model_config_path(model_name, base_path)
    model_layer = _typed_layer(read_yaml(model_path), types, model_path)
    if "model_name" in model_layer and model_layer["model_name"] != model_name:
      raise ConfigError(f"{model_path}: model_name={model_layer['model_name']!r} disagrees with the file name")
    values.update(model_layer)
    origins.update(dict.fromkeys(model_layer, f"model_name={model_name}"))
  values.update(override_layer)
  origins.update(dict.fromkeys(cli_text, "the command line"))
  origins.update(dict.fromkeys(overrides, "a keyword argument"))
  values["model_name"] = model_name
  logger.debug("merged config %s with overrides %s", model_name, sorted(override_layer))
  return values, origins


def load_config(argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
  """Loads, validates and derives a configuration.

  Order (later wins): the base YAML (argv[0] if it is a .yml path, else the package's base.yml; a YAML that sets
  `base_config` is laid over the file it names, see `read_config_yaml`), then
  `models/<model_name>.yml`, then the `key=value` items of argv and the keyword arguments (one layer: a key may
  not be set in both).

  Args:
    argv: optional base YAML path followed by `key=value` strings, as on the MaxText command line.
    **overrides: typed overrides, e.g. `model_name="qwen3-next-tiny", dtype="bfloat16"`.

  Returns:
    An immutable, hashable config: every base.yml key plus the derived values of `derived.derive`.

  Raises:
    ConfigError: an unknown key (with the closest known key), a key set twice in one layer, a value of the wrong
      type, or an inconsistent combination of values.
  """
  values = merge_layers(argv, **overrides)
  derived.validate(values)
  values.update(derived.derive(values))
  return ml_collections.FrozenConfigDict(values)


def config_to_dict(cfg: ml_collections.FrozenConfigDict) -> dict[str, Any]:
  """Returns a plain, JSON-friendly dict of a loaded config (tuples become lists)."""
  plain = cfg.as_configdict().to_dict()
  return {k: list(v) if isinstance(v, tuple) else v for k, v in plain.items()}
