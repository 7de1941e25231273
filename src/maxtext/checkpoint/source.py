"""One definition of a checkpoint source: a Hugging Face folder, a GGUF file or an Orbax folder, each named by one
config key, behind one interface that says what it supplies.

| config key             | source        | model keys  | tensors               | tokenizer, chat template          |
|------------------------|---------------|-------------|-----------------------|-----------------------------------|
| `hf_model_path`        | `HFFolder`    | config.json | safetensors, streamed | tokenizer.json, folder's template |
| `gguf_model_path`      | `GGUFFile`    | metadata    | dequantized, streamed | built from the metadata           |
| `load_parameters_path` | `OrbaxFolder` | none        | restored              | none                              |

The path keys are read here and nowhere else: the run config loader asks `model_source` for the model keys,
`load_model` asks `weights_source` for the tensors, the converter opens one source with `open_source`, the
tokenizer asks the model source for its tokenizer and chat template, and the vLLM adapter asks `names_checkpoint`.
A config names at most one model source (`hf_model_path` or `gguf_model_path`); an Orbax folder may stand beside
it, and then supplies the tensors while the other supplies the model keys and the tokenizer (what a converted
checkpoint's `maxtext_model.yml` says).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import ml_collections
import numpy as np

from maxtext.checkpoint import gguf, hf, hf_config
from maxtext.configs import ConfigError
from maxtext.configs.loader import DEFAULT_MODEL_NAME
from maxtext.models import Transformer, abstract_model, assign_params, flat_param_shapes

logger = logging.getLogger(__name__)

ORBAX_KEY = "load_parameters_path"
HF_KEY = "hf_model_path"
GGUF_KEY = "gguf_model_path"


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
  """Where a source's tokenizer comes from.

  Attributes:
    path: the tokenizer.json folder (Hugging Face) or the file holding the vocabulary (GGUF).
    parts: the tokenizer already built from the file's metadata (`gguf.GGUFTokenizerParts`), or None when `path`
      holds a tokenizer.json to read.
  """

  path: str
  parts: Any = None


class CheckpointSource(abc.ABC):
  """A checkpoint named by one config key: what it supplies and how to read it.

  Args:
    path: the value of the config key (a non-empty path).

  Raises:
    TypeError: `path` is not a string or path.
    ValueError: `path` is empty.
  """

  key: ClassVar[str]  # the config key naming this kind of source
  supplies_model_keys: ClassVar[bool] = True

  def __init__(self, path: str | os.PathLike):
    if not isinstance(path, (str, os.PathLike)):
      raise TypeError(f"{self.key} must be a path, got {type(path).__name__}")
    if not os.fspath(path):
      raise ValueError(f"{self.key} is empty; give the path of the checkpoint")
    self.path = os.fspath(path)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.key}={self.path!r})"

  @abc.abstractmethod
  def model_keys(self) -> dict[str, Any]:
    """The config keys the checkpoint implies (model shape, family, ...), without its own path key; {} when the
    checkpoint holds tensors only."""

  @abc.abstractmethod
  def load_model(
      self, cfg: ml_collections.FrozenConfigDict, *, progress: bool = True, into: Transformer | None = None
  ) -> Transformer:
    """The model of `cfg` with the checkpoint's tensors, in `cfg.weight_dtype` (`into`: a model to fill in place)."""

  @abc.abstractmethod
  def iter_params(
      self, cfg: ml_collections.FrozenConfigDict, *, progress: bool = False
  ) -> Iterator[tuple[str, np.ndarray]]:
    """The canonical parameters, one at a time: (flat name, array of `cfg.weight_dtype`)."""

  @abc.abstractmethod
  def load_config(self, argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
    """base.yml, then the checkpoint's model keys and its own path key, then `argv` and `overrides`.

    Raises:
      NotImplementedError: the source supplies no model keys.
    """

  def check_run_config(self, values: Mapping[str, Any]) -> None:
    """Raises ConfigError when the merged keys `values` cannot take their model keys from this source."""
    del values  # most sources accept every combination

  def tokenizer(self) -> TokenizerFiles | None:
    """Where the tokenizer comes from, or None when the checkpoint has none."""
    return None

  def chat_template(self) -> str | None:
    """The chat template the checkpoint carries, or None."""
    return None

  def tokenizer_keys(self) -> dict[str, Any]:
    """The config keys that keep this checkpoint's tokenizer and chat template once its tensors are converted."""
    return {}


class HFFolder(CheckpointSource):
  """A local Hugging Face folder: config.json, *.safetensors, tokenizer.json and its chat template."""

  key = HF_KEY

  def _require_folder(self) -> None:
    """Raises ConfigError when the path names a file (a folder that does not exist is the reader's error)."""
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      hint = "; a GGUF file is given as gguf_model_path" if self.path.lower().endswith(".gguf") else ""
      raise ConfigError(
          f"hf_model_path={self.path!r} is a file, not a folder; give the Hugging Face folder holding config.json,"
          f" *.safetensors and tokenizer.json{hint}"
      )

  def model_keys(self) -> dict[str, Any]:
    self._require_folder()
    return hf_config.hf_config_to_overrides(hf_config.read_hf_config(self.path))

  def load_config(self, argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
    self._require_folder()
    return hf.load_hf_config(self.path, argv, **overrides)

  def check_run_config(self, values: Mapping[str, Any]) -> None:
    """The folder must be a folder, and no `model_name` may name the model as well.

    Raises:
      ConfigError: naming both keys, or saying the path is not a folder.
    """
    self._require_folder()
    model_name = values.get("model_name", DEFAULT_MODEL_NAME)
    if model_name != DEFAULT_MODEL_NAME:
      raise ConfigError(
          f"hf_model_path={self.path!r} and model_name={model_name!r} both name the model; set one (the model keys"
          " come from the folder's config.json, so model_name would be ignored)"
      )

  def load_model(self, cfg, *, progress=True, into=None):
    model = abstract_model(cfg) if into is None else into
    assign_params(model, self.iter_params(cfg, progress=progress))
    return model

  def iter_params(self, cfg, *, progress=False):
    return hf.iter_hf_params(self.path, cfg, progress=progress)

  def tokenizer(self) -> TokenizerFiles:
    return TokenizerFiles(self.path)

  def chat_template(self) -> str | None:
    return folder_chat_template(self.path)

  def tokenizer_keys(self) -> dict[str, Any]:
    return {"tokenizer_path": self.path}


class GGUFFile(CheckpointSource):
  """A local GGUF file: metadata (the model keys), quantized tensors, the vocabulary and the chat template."""

  key = GGUF_KEY

  def model_keys(self) -> dict[str, Any]:
    return hf_config.hf_config_to_overrides(gguf.gguf_to_hf_config(gguf.open_gguf(self.path)))

  def load_config(self, argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
    return gguf.load_gguf_config(self.path, argv, **overrides)

  def load_model(self, cfg, *, progress=True, into=None):
    model = abstract_model(cfg) if into is None else into
    assign_params(model, self.iter_params(cfg, progress=progress))
    return model

  def iter_params(self, cfg, *, progress=False):
    return gguf.iter_gguf_params(self.path, cfg, progress=progress)

  def tokenizer(self) -> TokenizerFiles:
    return TokenizerFiles(self.path, gguf.load_gguf_tokenizer(self.path))

  def chat_template(self) -> str | None:
    return gguf.open_gguf(self.path).field("tokenizer.chat_template")

  def tokenizer_keys(self) -> dict[str, Any]:
    # The file stays the tokenizer's (and chat template's) source; the converted tensors replace its weights.
    return {GGUF_KEY: self.path}


class OrbaxFolder(CheckpointSource):
  """An Orbax parameter checkpoint (e.g. written by the converter): tensors only."""

  key = ORBAX_KEY
  supplies_model_keys = False

  def model_keys(self) -> dict[str, Any]:
    return {}

  def load_config(self, argv: Sequence[str] = (), **overrides: Any) -> ml_collections.FrozenConfigDict:
    raise NotImplementedError(
        f"{self.key}: an Orbax folder holds tensors only, no model keys; give the model keys (a converted"
        " checkpoint's maxtext_model.yml, model_name, hf_model_path or gguf_model_path)"
    )

  def load_model(self, cfg, *, progress=True, into=None):
    del progress, into  # Orbax restores straight into a new model's shardings
    from maxtext.checkpoint import orbax  # pylint: disable=import-outside-toplevel  # a fifth of a second: on use

    logger.info("restoring parameters from %s", self.path)
    return orbax.restore_model(self.path, cfg)

  def iter_params(self, cfg, *, progress=False):
    del progress  # restored in one call
    from maxtext.checkpoint import orbax  # pylint: disable=import-outside-toplevel  # a fifth of a second: on use

    return iter(orbax.restore_params(self.path, flat_param_shapes(cfg)).items())


# Every source, by its config key. The order is the precedence for the tensors: a tensors-only source (a converted
# copy) before the model sources.
_SOURCES: dict[str, type[CheckpointSource]] = {cls.key: cls for cls in (OrbaxFolder, HFFolder, GGUFFile)}
SOURCE_KEYS: tuple[str, ...] = tuple(_SOURCES)
# The keys of the sources that supply model keys and a tokenizer; a config sets at most one of them.
MODEL_SOURCE_KEYS: tuple[str, ...] = tuple(key for key, cls in _SOURCES.items() if cls.supplies_model_keys)


def open_source(key: str, path: str | os.PathLike) -> CheckpointSource:
  """The source a config key names.

  Raises:
    ValueError: an unknown key, or an empty path.
    TypeError: `path` is not a path.
  """
  if key not in _SOURCES:
    raise ValueError(f"{key!r} names no checkpoint source; the source keys are {', '.join(SOURCE_KEYS)}")
  return _SOURCES[key](path)


def _get(cfg: Any, key: str) -> Any:
  """A key of a config (attribute access) or of a mapping of config keys."""
  return cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)


def configured_sources(cfg: Any) -> dict[str, CheckpointSource]:
  """`{key: source}` of every source key `cfg` (a config or a mapping of its keys) sets, in SOURCE_KEYS order."""
  return {key: open_source(key, _get(cfg, key)) for key in SOURCE_KEYS if _get(cfg, key)}


def names_checkpoint(cfg: Any) -> bool:
  """Whether `cfg` sets any source key."""
  return any(_get(cfg, key) for key in SOURCE_KEYS)


def model_source(cfg: Any, origins: Mapping[str, str] | None = None) -> CheckpointSource | None:
  """The source of the model keys and the tokenizer (the Hugging Face folder or the GGUF file), or None.

  Args:
    cfg: a config, or a mapping of its keys.
    origins: where each key was set (`loader.merge_layers_with_origins`), to name it in the error; None when
      unknown.

  Raises:
    ConfigError: more than one is set (naming, when `origins` says so, the layer that set each).
  """
  given = {key: _get(cfg, key) for key in MODEL_SOURCE_KEYS if _get(cfg, key)}
  if len(given) > 1:
    if origins is None:
      named = " and ".join(f"{key}={path!r}" for key, path in given.items())
      raise ConfigError(f"{named} are both set; set one (the model keys come from either)")
    by_origin: dict[str, list[str]] = {}
    for key, path in given.items():
      by_origin.setdefault(origins.get(key, "the config"), []).append(f"{key}={path!r}")
    named = " and ".join(f"{origin} sets {' and '.join(keys)}" for origin, keys in by_origin.items())
    advice = "set one (the model keys come from either)"
    from_model = [key for key in given if origins.get(key, "").startswith("model_name=")]
    if from_model:
      others = " or ".join(key for key in given if key not in from_model)
      advice = f"drop {origins[from_model[0]]} (its model config names {from_model[0]}) or {others}"
    raise ConfigError(f"{named}; a run takes its model from one source: {advice}")
  if not given:
    return None
  ((key, path),) = given.items()
  return open_source(key, path)


def weights_source(cfg: Any) -> CheckpointSource | None:
  """The source of the tensors: a tensors-only source when set (e.g. the converted Orbax copy), else the model
  source, else None.

  Raises:
    ConfigError: more than one model source is set.
  """
  model = model_source(cfg)
  for key in SOURCE_KEYS:
    if key not in MODEL_SOURCE_KEYS and _get(cfg, key):
      return open_source(key, _get(cfg, key))
  return model


def exactly_one_model_source(paths: Mapping[str, str | os.PathLike | None], where: str) -> CheckpointSource:
  """The one model source of `paths` ({key: path or None}), e.g. a command line's choice.

  Raises:
    ValueError: none or more than one is given (naming the keys and `where`), or an unknown key.
  """
  given = {key: path for key, path in paths.items() if path is not None}
  if len(given) != 1:
    raise ValueError(f"give exactly one of {' and '.join(paths)} to {where}")
  ((key, path),) = given.items()
  if key not in MODEL_SOURCE_KEYS:
    raise ValueError(f"{key!r} is no model source; give one of {', '.join(MODEL_SOURCE_KEYS)}")
  return open_source(key, path)


def folder_chat_template(folder: str) -> str | None:
  """The chat template of a tokenizer folder: `chat_template.jinja`, else `tokenizer_config.json`'s
  `chat_template` (a string, or a list of {"name", "template"} whose "default" entry is used), else None.

  Raises:
    ValueError: tokenizer_config.json is not valid JSON.
  """
  jinja = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  config_path = os.path.join(folder, "tokenizer_config.json")
  template = None
  if os.path.isfile(config_path):
    with open(config_path, encoding="utf-8") as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return template if isinstance(template, str) else None
