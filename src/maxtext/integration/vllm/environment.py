"""Importing vLLM / tpu-inference modules where they are installed, with an error naming the package otherwise."""

from __future__ import annotations

import importlib
import types

# The tpu-inference release this package's runner-facing code was checked against (docs/runner-contract.md).
CHECKED_TPU_INFERENCE_VERSION = "0.32.0"
INSTALL_HINT = f"on a TPU VM, pip install vllm-tpu=={CHECKED_TPU_INFERENCE_VERSION} (see docs/serving.md)"


class PluginEnvironmentError(RuntimeError):
  """vLLM or tpu-inference is missing, or does not offer what this package needs."""


def import_module_of(module: str, package: str, needed_by: str) -> types.ModuleType:
  """Imports `module` (part of the pip package `package`) for `needed_by`.

  Raises:
    PluginEnvironmentError: the import failed; the message names the package, the module and the error.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise PluginEnvironmentError(
        f"{needed_by} needs the {package} package, but importing {module} failed ({e}); {INSTALL_HINT}"
    ) from e
