"""Shared pytest setup: fake CPU devices for sharding code, float32 matmuls at full precision; the example model
and the tpu-inference wheel, each fetched once."""

import importlib.util
import pathlib

import jax
import pytest

from maxtext.testing import tpu_inference_wheel

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Sharding code runs on fake CPU devices; this must happen before JAX initialises its backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def example_gguf() -> str:
  """The README's example model (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched once into the user cache by
  scripts/fetch_example_model.py (a no-op when CI or an earlier run already fetched it)."""
  spec = importlib.util.spec_from_file_location("fetch_example_model", ROOT / "scripts" / "fetch_example_model.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.fetch()


@pytest.fixture(scope="session", name="tpu_inference_source")
def fixture_tpu_inference_source():
  """The unpacked tpu-inference wheel (downloaded once into the cache dir; CI has PyPI access)."""
  return tpu_inference_wheel.fetch_wheel_source()


@pytest.fixture(scope="session", name="tpu_inference_refs")
def fixture_tpu_inference_refs(tpu_inference_source):
  """The wheel's pure-JAX reference kernels, loaded by file path."""
  return tpu_inference_wheel.load_references(tpu_inference_source)
