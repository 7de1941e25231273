"""Types of the configuration keys and value coercion.

The type of every key is the type of its default in `base.yml`; list keys take their element type from their
declaration in `keys.py`. Coercion is strict: an int is accepted where a float is expected, nothing else changes
type.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from maxtext.configs import keys
from maxtext.configs.errors import ConfigError

# Element types of list-valued keys (their defaults may be empty, so the element type cannot be inferred).
LIST_ELEMENT_TYPES = keys.LIST_ELEMENT_TYPES


def key_types(defaults: Mapping[str, Any]) -> dict[str, type]:
  """Returns the type of every key, inferred from its default in base.yml.

  Args:
    defaults: the parsed base.yml.

  Returns:
    {key: bool | int | float | str | list}.

  Raises:
    ConfigError: a default has an unsupported type, or a list key has no declared element type.
  """
  types = {}
  for key, value in defaults.items():
    if isinstance(value, (bool, int, float, str)):
      types[key] = type(value)
    elif isinstance(value, list):
      if key not in LIST_ELEMENT_TYPES:
        raise ConfigError(
            f"base.yml key {key!r} is a list but has no element type (its declaration in configs/keys.py needs"
            " element=)"
        )
      types[key] = list
    else:
      raise ConfigError(f"base.yml key {key!r} must default to a bool, int, float, str or list; got {value!r}")
  return types


def suggest_key(key: str, known: Sequence[str]) -> str:
  """Returns a ' (did you mean ...?)' hint naming the closest known key, or ''."""
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
  return type(value).__name__


def coerce_value(key: str, value: Any, expected: type, source: str) -> Any:
  """Checks `value` against the key's type and returns it in canonical form (lists become tuples).

  Args:
    key: the configuration key.
    value: the value given.
    expected: the key's type (from `key_types`).
    source: where the value came from, for the message (a file, "command line", "keyword argument").

  Returns:
    The value, with ints widened to float for float keys and lists converted to tuples.

  Raises:
    ConfigError: the value has the wrong type.
  """
  where = f"{key}={value!r} ({source})"
  if expected is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{where}: must be a bool (true or false), got {_type_name(value)}")
  if expected is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return int(value)
    raise ConfigError(f"{where}: must be an integer, got {_type_name(value)}")
  if expected is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    raise ConfigError(f"{where}: must be a number, got {_type_name(value)}")
  if expected is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{where}: must be a string, got {_type_name(value)}")
  # Lists: every element must have the declared element type.
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"{where}: must be a list, got {_type_name(value)}")
  element_type = LIST_ELEMENT_TYPES[key]
  items = []
  for i, item in enumerate(value):
    if element_type is list and isinstance(item, tuple):
      item = list(item)
    ok = isinstance(item, element_type) and not (element_type is int and isinstance(item, bool))
    if not ok:
      raise ConfigError(f"{where}: element {i} must be {element_type.__name__}, got {item!r} ({_type_name(item)})")
    items.append(_freeze(item) if element_type is list else item)
  return tuple(items)


def _freeze(value: Any) -> Any:
  """Nested lists as nested tuples (configs are immutable and hashable)."""
  return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def parse_command_line_value(key: str, text: str, expected: type) -> Any:
  """Parses the text of a `key=value` override into a value of the key's type.

  Strings are taken verbatim; numbers accept any spelling Python's float() does (`1e-5`); bools accept YAML's
  true/false; lists are YAML flow sequences (`[1, 2, 3]`) or comma-separated items.

  Raises:
    ConfigError: the text does not parse as the key's type.
  """
  if expected is str:
    return text
  if expected is float:
    try:
      return float(text)
    except ValueError:
      raise ConfigError(f"{key}={text!r} (command line): must be a number") from None
  if expected is int:
    try:
      return int(text, 10)
    except ValueError:
      raise ConfigError(f"{key}={text!r} (command line): must be an integer") from None
  if expected is bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise ConfigError(f"{key}={text!r} (command line): must be a bool (true or false)")
  # List: YAML flow sequence, or comma separated items.
  stripped = text.strip()
  if stripped.startswith("["):
    try:
      parsed = yaml.safe_load(stripped)
    except yaml.YAMLError as e:
      raise ConfigError(f"{key}={text!r} (command line): not a valid list: {e}") from None
    return coerce_value(key, parsed, list, "command line")
  if not stripped:
    return ()
  element_type = LIST_ELEMENT_TYPES[key]
  items = []
  for item in stripped.split(","):
    item = item.strip()
    if element_type is int:
      try:
        items.append(int(item, 10))
      except ValueError:
        raise ConfigError(f"{key}={text!r} (command line): element {item!r} must be an integer") from None
    else:
      items.append(item)
  return tuple(items)
