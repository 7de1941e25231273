"""Shared pytest setup: fake CPU devices for sharding code, float32 matmuls at full precision, a compilation cache
shared by every test process; the example model and the tpu-inference wheel, each fetched once."""

import atexit
import importlib.util
import os
import pathlib
import shutil
import tempfile

# Most tests build the same tiny models and jit the same steps, each test in fresh closures that JAX's in-memory
# cache cannot reuse. JAX's persistent compilation cache is keyed by the lowered program, the compile options and
# the jax/jaxlib versions, so a hit is the executable a compile would have produced; sharing it (through the
# environment, before JAX is imported) lets test workers and the CLI subprocesses the tests start load instead of
# recompile. The size limit turns on JAX's file lock, which parallel workers need; it also makes every write scan
# the whole folder to evict, so only compiles of at least a second (JAX's default) are kept: model steps, not the
# thousands of single ops that eager code compiles (keeping those too made the suite's later tests 6x slower).
# Set MAXTEXT_TEST_COMPILATION_CACHE to another folder, or to "off" (then nothing is cached, not even in the
# engine's own folder, the config key compilation_cache_dir).
_COMPILATION_CACHE = os.environ.get("MAXTEXT_TEST_COMPILATION_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "maxtext", "jax-test-compilation-cache"
)
if _COMPILATION_CACHE != "off":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILATION_CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
else:
  os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

# The engine keeps the prepared weights of every checkpoint it loads (checkpoint/weight_cache.py); the suite's
# checkpoints are random and short-lived, so they go to a folder of the test session, never into the user's cache.
if "MAXTEXT_WEIGHT_CACHE_DIR" not in os.environ:
  os.environ["MAXTEXT_WEIGHT_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxtext-test-weights-")
  atexit.register(shutil.rmtree, os.environ["MAXTEXT_WEIGHT_CACHE_DIR"], ignore_errors=True)

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from support import tpu_inference_wheel  # pylint: disable=wrong-import-position

# The upstream tier runs in its own venv with vLLM and tpu-inference (scripts/upstream_tier.sh), not in this suite.
collect_ignore = ["upstream"]

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Sharding code runs on fake CPU devices; this must happen before JAX initialises its backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")


def _fetched(model: str) -> str:
  """An example model's GGUF file, fetched once into the user cache by scripts/fetch_example_model.py (a no-op when
  CI or an earlier run already fetched it). Offline, the test is skipped, except under CI, where it fails."""
  spec = importlib.util.spec_from_file_location("fetch_example_model", ROOT / "scripts" / "fetch_example_model.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  try:
    return module.fetch(model=model)
  except module.FetchError as e:
    if os.environ.get("CI"):
      raise
    return pytest.skip(f"the example model {model} could not be fetched (offline?): {e}")


@pytest.fixture(scope="session")
def example_gguf() -> str:
  """The README's example model, SmolLM2-135M-Instruct (Q4_1 GGUF)."""
  return _fetched("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_270m_gguf() -> str:
  """The README's second example model, Gemma 3 270M (Q4_K_M GGUF)."""
  return _fetched("gemma3-270m")


@pytest.fixture(scope="session", name="tpu_inference_source")
def fixture_tpu_inference_source():
  """The unpacked tpu-inference wheel (downloaded once into the cache dir; CI has PyPI access)."""
  return tpu_inference_wheel.fetch_wheel_source()


@pytest.fixture(scope="session", name="tpu_inference_refs")
def fixture_tpu_inference_refs(tpu_inference_source):
  """The wheel's pure-JAX reference kernels, loaded by file path."""
  return tpu_inference_wheel.load_references(tpu_inference_source)
