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

from maxtext.integration.vllm.adapter import MaxTextForCausalLM
from maxtext.integration.vllm.environment import CHECKED_TPU_INFERENCE_VERSION, PluginEnvironmentError, import_module_of

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURE", "MODEL_LOADER_MODULE", "PluginEnvironmentError", "register"]

ARCHITECTURE = "MaxTextForCausalLM"
MODEL_LOADER_MODULE = "tpu_inference.models.common.model_loader"
_NEEDED_BY = "the maxtext vLLM plugin"


def register() -> None:
  """Registers `MaxTextForCausalLM` under the architecture name "MaxTextForCausalLM" with tpu-inference.

  Safe to call more than once (vLLM may load plugins in several processes; a repeated registration replaces the
  entry with the same class).

  Raises:
    PluginEnvironmentError: vLLM or tpu-inference cannot be imported, or tpu-inference has no `register_model`.
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
  logger.info("registered %s with tpu-inference", ARCHITECTURE)
