"""`MaxTextForCausalLM`: the model (`maxtext.causal_lm.CausalLM`) as tpu-inference's runner builds it.

The runner builds the class as `cls(vllm_config, rng_key, mesh)` and calls the contract `CausalLM` implements
(docs/runner-contract.md). This module keeps what only vLLM needs: the model's config read from a `VllmConfig`
(`maxtext_config_from_vllm`), that constructor, the cache specs as plain data for a runner that asks, and the module
walk vLLM's engine does at cleanup. The plugin (`plugin.py`) registers this class.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_collections
from flax import nnx

from maxtext.causal_lm import CHECKPOINT_KEYS, CausalLM
from maxtext.checkpoint import load_run_config
from maxtext.configs import run_options
from maxtext.configs.errors import ConfigError
from maxtext.kv_cache import kv_cache_spec_data

MAXTEXT_CONFIG_KEY = "maxtext_config"
DUMMY_LOAD_FORMAT = "dummy"
RUNNER_DTYPES = ("float32", "bfloat16")
# Model-config keys that only this package's CPU engine applies: under vLLM they would do nothing, so
# `maxtext_config` refuses them, naming what takes their place.
VLLM_REPLACES = {
    "max_target_length": "vLLM's --max-model-len",
    "max_num_seqs": "vLLM's --max-num-seqs",
    "max_num_batched_tokens": "vLLM's --max-num-batched-tokens",
    "admission_reserve": "nothing: vLLM's scheduler admits a request when the blocks of its tokens scheduled now fit",
    "enable_prefix_caching": "vLLM's --enable-prefix-caching / --no-enable-prefix-caching",
    "num_kv_blocks": "vLLM's --num-gpu-blocks-override (the runner sizes the cache)",
    "kv_cache_memory_bytes": "vLLM's --kv-cache-memory-bytes (the runner sizes the cache)",
    "min_token_bucket": "tpu-inference's own token padding",
    "quantization": "nothing: the CPU engine's cpu kernels read int8 weights; under vLLM they stay in weight_dtype",
    "greedy_head_candidates": "nothing: the runner samples from the full logits",
}


def _attr(obj: Any, path: str, default: Any = None) -> Any:
  """Reads a dotted attribute path of a vllm_config-like object; missing parts give `default`."""
  for part in path.split("."):
    if obj is None or not hasattr(obj, part):
      return default
    obj = getattr(obj, part)
  return obj


def maxtext_config_from_vllm(vllm_config: Any) -> ml_collections.FrozenConfigDict:
  """Builds the model's config (`run_options.model_config`) from a vLLM config, read by attribute only.

  `additional_config["maxtext_config"]` holds config overrides (`model_name`, `hf_model_path`, ...), as a real
  `VllmConfig` carries them (`--additional-config`); the keys that only steer a `maxtext-decode` run (prompts,
  sampling defaults, output, the reference runner's CPU knobs) and those vLLM's own settings replace
  (`VLLM_REPLACES`) are refused there. Unless overridden, the cache block
  size and dtype come from `cache_config` and `dtype` / `weight_dtype` from `model_config.dtype`;
  `load_format == "dummy"` means random weights, so `load_parameters_path`, `hf_model_path` and `gguf_model_path`
  are cleared. Otherwise, when the overrides name no checkpoint and no `model_name`, vLLM's model folder
  (`model_config.model`, holding config.json) is the Hugging Face checkpoint, as for any model vLLM serves.

  Raises:
    TypeError: `additional_config` or its `maxtext_config` entry is not a mapping.
    ConfigError: the overrides name a run option or a key only the CPU engine applies (`VLLM_REPLACES`), or do
      not form a valid config.
    ValueError (from `_runner_dtype`): `model_config.dtype` is neither float32 nor bfloat16.
  """
  additional = _attr(vllm_config, "additional_config") or {}
  if not isinstance(additional, Mapping):
    raise TypeError(f"vllm_config.additional_config must be a mapping, got {type(additional).__name__}")
  overrides = additional.get(MAXTEXT_CONFIG_KEY) or {}
  if not isinstance(overrides, Mapping):
    raise TypeError(
        f"vllm_config.additional_config[{MAXTEXT_CONFIG_KEY!r}] must be a mapping of config keys, "
        f"got {type(overrides).__name__}"
    )
  where = f"vllm_config.additional_config[{MAXTEXT_CONFIG_KEY!r}]"
  run_options.reject_run_options(overrides, where)
  replaced = sorted(key for key in overrides if key in VLLM_REPLACES)
  if replaced:
    raise ConfigError(
        f"{where} sets {replaced[0]}={overrides[replaced[0]]!r}, which only maxtext's CPU engine applies; under vLLM"
        f" it would do nothing (in its place: {VLLM_REPLACES[replaced[0]]}): remove it"
    )
  overrides = dict(overrides)
  dtype = _runner_dtype(vllm_config)
  if dtype is not None:
    overrides.setdefault("dtype", dtype)
    overrides.setdefault("weight_dtype", dtype)
  block_size = _attr(vllm_config, "cache_config.block_size")
  if block_size is not None and "block_size" not in overrides:
    overrides["block_size"] = int(block_size)
  cache_dtype = _attr(vllm_config, "cache_config.cache_dtype")
  if cache_dtype not in (None, "auto") and "kv_cache_dtype" not in overrides:
    overrides["kv_cache_dtype"] = str(cache_dtype)
  if _attr(vllm_config, "load_config.load_format") == DUMMY_LOAD_FORMAT:
    overrides.update({key: "" for key in CHECKPOINT_KEYS})
  elif not any(overrides.get(key) for key in CHECKPOINT_KEYS) and "model_name" not in overrides:
    model_folder = _attr(vllm_config, "model_config.model")
    if isinstance(model_folder, str) and os.path.isfile(os.path.join(model_folder, "config.json")):
      overrides["hf_model_path"] = model_folder  # vLLM's `model=` folder is the checkpoint
  return run_options.model_config(load_run_config(**overrides))


def _runner_dtype(vllm_config: Any) -> str | None:
  """`model_config.dtype` (a torch dtype, read by name only) as this package's dtype name, or None.

  Raises:
    ValueError: a dtype this package does not compute in.
  """
  dtype = _attr(vllm_config, "model_config.dtype")
  if dtype is None:
    return None
  name = str(dtype).removeprefix("torch.")
  if name not in RUNNER_DTYPES:
    raise ValueError(
        f"vllm_config.model_config.dtype must be one of {', '.join(RUNNER_DTYPES)} for this model; got {name!r}"
    )
  return name


class MaxTextForCausalLM(CausalLM):
  """`CausalLM` built from the runner's `vllm_config`, with the methods only vLLM calls."""

  def __init__(
      self,
      vllm_config: Any,
      rng_key: jax.Array,
      mesh: jax.sharding.Mesh | None = None,
      *,
      built_config: ml_collections.FrozenConfigDict | None = None,
  ):
    """Builds the model as the runner does, `cls(vllm_config, rng_key, mesh)`; see `from_config` for the other way.

    Args:
      vllm_config: the runner's config, read by attribute (`maxtext_config_from_vllm`); None with `built_config`.
      rng_key: the key of random (dummy) weights.
      mesh: the runner's device mesh, or None for one device.
      built_config: a config already built by `load_run_config`, instead of `vllm_config` (`from_config`).

    Raises:
      TypeError: both or neither of `vllm_config` and `built_config`, or `built_config` is not a built config.
    """
    self.vllm_config = vllm_config
    if built_config is None:
      if vllm_config is None:
        raise TypeError("MaxTextForCausalLM needs a vllm_config (or a built config, through from_config)")
      cfg = maxtext_config_from_vllm(vllm_config)
      is_dummy = _attr(vllm_config, "load_config.load_format") == DUMMY_LOAD_FORMAT
    else:
      if vllm_config is not None:
        raise TypeError("MaxTextForCausalLM takes a vllm_config or a built_config, not both")
      cfg = run_options.model_config(built_config)
      is_dummy = not any(cfg[key] for key in CHECKPOINT_KEYS)
    # A backend's options are run options (`cpu_weight_panels`, ...): read from the run's config when there is one;
    # under vLLM, which carries none, the backend keeps its defaults.
    super().__init__(cfg, rng_key, mesh, is_dummy=is_dummy, run_config=built_config)

  @classmethod
  def from_config(
      cls, cfg: ml_collections.FrozenConfigDict, rng_key: jax.Array, mesh: jax.sharding.Mesh | None = None
  ) -> MaxTextForCausalLM:
    """The model of a config this package already built (`load_run_config`): the reference runner's constructor.

    The model keeps `cfg`'s model keys only (`run_options.model_config`), the same config `maxtext_config_from_vllm`
    builds from the same keys, and has random weights when `cfg` names no checkpoint (vLLM's `load_format="dummy"`).

    Raises:
      TypeError: `cfg` is not a built config.
    """
    return cls(None, rng_key, mesh, built_config=cfg)

  def get_kv_cache_spec_data(self) -> dict[str, dict[str, Any]]:
    """The cache each layer needs, as plain data for a runner that asks (docs/tpu-inference-kv-cache-spec.patch).

    See `kv_cache_spec_data.kv_cache_spec_data` for the format: attention layers with their window, Gated DeltaNet
    layers as mamba states with shapes and dtypes, and the KV-sharing layers' targets.
    """
    return kv_cache_spec_data.kv_cache_spec_data(self.cfg)

  def modules(self) -> Iterator[nnx.Module]:
    """This model and every nnx module inside it, the model first, as torch's `nn.Module.modules()` walks a model.

    vLLM's offline engine walks the driver's model this way when the engine is released or the interpreter exits
    (`LLMEngine._cleanup_instance_caches`), to undo the hooks of the `torch.compile` wrappers it finds. This model is
    compiled by JAX and holds no such wrapper, so that walk releases nothing here; it only needs the modules.
    """
    yield self
    for _, module in nnx.iter_modules(self):
      if module is not self:
        yield module
