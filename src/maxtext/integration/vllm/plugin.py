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

import importlib
import logging

from maxtext.integration.vllm.adapter import MaxTextForCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURE = "MaxTextForCausalLM"
# The tpu-inference release whose registration contract this module was checked against (docs/runner-contract.md).
CHECKED_TPU_INFERENCE_VERSION = "0.32.0"
MODEL_LOADER_MODULE = "tpu_inference.models.common.model_loader"
_INSTALL_HINT = f"on a TPU VM, pip install vllm-tpu=={CHECKED_TPU_INFERENCE_VERSION} (see docs/serving.md)"


class PluginEnvironmentError(RuntimeError):
  """vLLM or tpu-inference is missing, or does not offer what the plugin needs."""


def _import(module: str, package: str):
  """Imports `module`, turning a failure into an error that names the pip package to install."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise PluginEnvironmentError(
        f"the maxtext vLLM plugin needs the {package} package, but importing {module} failed ({e}); {_INSTALL_HINT}"
    ) from e


def register() -> None:
  """Registers `MaxTextForCausalLM` under the architecture name "MaxTextForCausalLM" with tpu-inference.

  Safe to call more than once (vLLM may load plugins in several processes; a repeated registration replaces the
  entry with the same class).

  Raises:
    PluginEnvironmentError: vLLM or tpu-inference cannot be imported, or tpu-inference has no `register_model`.
  """
  _import("vllm", "vllm")
  loader = _import(MODEL_LOADER_MODULE, "tpu-inference")
  register_model = getattr(loader, "register_model", None)
  if not callable(register_model):
    raise PluginEnvironmentError(
        f"{MODEL_LOADER_MODULE} has no callable register_model; the maxtext plugin was checked against "
        f"tpu-inference {CHECKED_TPU_INFERENCE_VERSION}"
    )
  register_model(ARCHITECTURE, MaxTextForCausalLM)
  logger.info("registered %s with tpu-inference", ARCHITECTURE)
