"""The vLLM plugin: makes `MaxTextForCausalLM` known to tpu-inference, so `vllm serve` can select it.

vLLM calls every function registered under the `vllm.general_plugins` entry point group in each of its processes
(this package registers `register` there, see pyproject.toml). `register()` hands the class to tpu-inference's
`register_model`, which checks the class's interface, records it for the JAX model loader and registers a
placeholder with vLLM's model registry. A served model then selects it with
`--hf-overrides '{"architectures": ["MaxTextForCausalLM"]}'` (docs/serving.md).

Nothing here patches vLLM or tpu-inference: without them, `register()` fails with an error naming the missing
package instead of defining stand-ins.
"""

from __future__ import annotations

import logging
from typing import Any

from maxtext.kv_cache import kv_cache_spec
from maxtext.integration.vllm.adapter import MaxTextForCausalLM, maxtext_config_from_vllm
from maxtext.integration.vllm.environment import CHECKED_TPU_INFERENCE_VERSION, PluginEnvironmentError, import_module_of
from maxtext.kv_cache.cache_spec import RecurrentSpec

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURE", "MODEL_LOADER_MODULE", "PluginEnvironmentError", "register"]

ARCHITECTURE = "MaxTextForCausalLM"
MODEL_LOADER_MODULE = "tpu_inference.models.common.model_loader"
MODELS_CONFIG_MODULE = "vllm.model_executor.models.config"
_NEEDED_BY = "the maxtext vLLM plugin"


class MaxTextModelConfig:
  """vLLM's per-architecture config hook for MaxTextForCausalLM (its entry in `MODELS_CONFIG_MAP`, which vLLM calls
  while it builds a `VllmConfig`, in every process).

  vLLM gives its own hybrid models Mamba's cache settings this way (`MambaModelConfig`): with prefix caching, the
  recurrent states are saved per block (`mamba_cache_mode="align"`, `mamba_block_size` = `block_size`) and the
  scheduler ends prefill chunks on those blocks; without, one state per request. vLLM cannot know that this one
  architecture name serves hybrid models too, so the hook applies the same settings when the configured model has
  recurrent layers, and leaves attention-only models as they are.
  """

  @staticmethod
  def verify_and_update_config(vllm_config: Any) -> None:
    """Applies vLLM's `MambaModelConfig` settings to `vllm_config` when the model has recurrent layers."""
    cfg = maxtext_config_from_vllm(vllm_config)
    if any(isinstance(spec, RecurrentSpec) for spec in kv_cache_spec.get_kv_cache_specs(cfg).values()):
      import_module_of(MODELS_CONFIG_MODULE, "vllm", _NEEDED_BY).MambaModelConfig.verify_and_update_config(vllm_config)

  @staticmethod
  def verify_and_update_model_config(model_config: Any) -> None:
    """The hook's other half, called on the model config alone: nothing to update."""
    del model_config


def register() -> None:
  """Registers `MaxTextForCausalLM` under the architecture name "MaxTextForCausalLM" with tpu-inference, and its
  config hook (`MaxTextModelConfig`) with vLLM.

  Safe to call more than once (vLLM may load plugins in several processes; a repeated registration replaces the
  entry with the same class).

  Raises:
    PluginEnvironmentError: vLLM or tpu-inference cannot be imported, tpu-inference has no `register_model`, or
      vLLM no `MODELS_CONFIG_MAP`.
  """
  import_module_of("vllm", "vllm", _NEEDED_BY)
  loader = import_module_of(MODEL_LOADER_MODULE, "tpu-inference", _NEEDED_BY)
  register_model = getattr(loader, "register_model", None)
  if not callable(register_model):
    raise PluginEnvironmentError(
        f"{MODEL_LOADER_MODULE} has no callable register_model; the maxtext plugin was checked against "
        f"tpu-inference {CHECKED_TPU_INFERENCE_VERSION}"
    )
  register_model(ARCHITECTURE, MaxTextForCausalLM)
  config_map = getattr(import_module_of(MODELS_CONFIG_MODULE, "vllm", _NEEDED_BY), "MODELS_CONFIG_MAP", None)
  if not isinstance(config_map, dict):
    raise PluginEnvironmentError(
        f"{MODELS_CONFIG_MODULE} has no MODELS_CONFIG_MAP dict; the maxtext plugin was checked against vLLM "
        f"{CHECKED_TPU_INFERENCE_VERSION}"
    )
  config_map[ARCHITECTURE] = MaxTextModelConfig
  logger.info("registered %s with tpu-inference and its config hook with vLLM", ARCHITECTURE)
