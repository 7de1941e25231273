"""Shared pytest setup: fake CPU devices for sharding code, float32 matmuls at full precision, the tpu-inference wheel."""

import jax
import pytest

from maxtext.testing import tpu_inference_wheel

# Sharding code runs on fake CPU devices; this must happen before JAX initialises its backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", name="tpu_inference_source")
def fixture_tpu_inference_source():
  """The unpacked tpu-inference wheel (downloaded once into the cache dir; CI has PyPI access)."""
  return tpu_inference_wheel.fetch_wheel_source()


@pytest.fixture(scope="session", name="tpu_inference_refs")
def fixture_tpu_inference_refs(tpu_inference_source):
  """The wheel's pure-JAX reference kernels, loaded by file path."""
  return tpu_inference_wheel.load_references(tpu_inference_source)
