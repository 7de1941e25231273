"""A stand-in for the parts of vLLM's `VllmConfig` that the adapter reads, for tests without vLLM installed.

The adapter reads a vLLM config by attribute only (`model_config.model`, `model_config.dtype`,
`load_config.load_format`, `cache_config`, `additional_config`), so these dataclasses and a real `VllmConfig` are
interchangeable for it. `additional_config["maxtext_config"]` holds plain overrides, as `--additional-config` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model part: vLLM's model folder and torch dtype (None: unset)."""

  model: str | None = None
  dtype: Any = None


@dataclasses.dataclass(frozen=True)
class LoadConfig:
  """How weights load: "dummy" means random weights."""

  load_format: str = "auto"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Cache block size and dtype."""

  block_size: int = 16
  cache_dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class FakeVllmConfig:
  """What the adapter reads of a `VllmConfig`."""

  model_config: ModelConfig | None = None
  load_config: LoadConfig | None = None
  cache_config: CacheConfig | None = None
  additional_config: Any = None


def fake_vllm_config(
    overrides: Mapping[str, Any] | None = None, *, load_format: str = "auto", block_size: int = 16, **model: Any
) -> FakeVllmConfig:
  """A vLLM config carrying `overrides` in `additional_config["maxtext_config"]`.

  Args:
    overrides: config keys, as `--additional-config '{"maxtext_config": {...}}'` gives them.
    load_format: "dummy" for random weights, else "auto".
    block_size: the runner's cache block size.
    **model: `ModelConfig` fields (`model=` folder, `dtype=`).
  """
  return FakeVllmConfig(
      model_config=ModelConfig(**model),
      load_config=LoadConfig(load_format),
      cache_config=CacheConfig(block_size=block_size),
      additional_config={"maxtext_config": dict(overrides or {})},
  )
