"""The small vLLM-config-shaped object the reference runner hands to `MaxTextForCausalLM`.

The adapter reads a vLLM config by attribute only (`model_config.hf_config`, `load_config.load_format`,
`additional_config`, `cache_config`, `sharding_config`), so a real `VllmConfig` and this object are
interchangeable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model part: the Hugging Face config (None: the maxtext config says everything)."""

  hf_config: Any = None
  max_model_len: int = 0


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
class ShardingConfig:
  """Tensor-parallel size."""

  tensor_parallelism: int = 1


@dataclasses.dataclass(frozen=True)
class ReferenceVllmConfig:
  """What the adapter reads of a `VllmConfig`."""

  model_config: ModelConfig
  load_config: LoadConfig
  cache_config: CacheConfig
  sharding_config: ShardingConfig
  additional_config: dict[str, Any]


def vllm_config_from_maxtext(cfg: ml_collections.FrozenConfigDict) -> ReferenceVllmConfig:
  """A vLLM-shaped config that hands the adapter exactly `cfg`, already built (it is not parsed again).

  `additional_config["maxtext_config"]` is `cfg` itself; `load_format` is "dummy" (random weights) when neither
  `load_parameters_path` nor `hf_model_path` is set. A real `VllmConfig` carries plain overrides there instead,
  from which the adapter builds the config.
  """
  has_checkpoint = bool(cfg.load_parameters_path or cfg.hf_model_path)
  return ReferenceVllmConfig(
      model_config=ModelConfig(hf_config=None, max_model_len=cfg.max_target_length),
      load_config=LoadConfig(load_format="auto" if has_checkpoint else "dummy"),
      cache_config=CacheConfig(block_size=cfg.block_size, cache_dtype=cfg.kv_cache_dtype),
      sharding_config=ShardingConfig(tensor_parallelism=cfg.ici_tensor_parallelism),
      additional_config={"maxtext_config": cfg},
  )
