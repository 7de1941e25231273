"""The compilation cache folder (config key compilation_cache_dir): where JAX keeps compiled programs across runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from maxtext.configs.errors import ConfigError
from maxtext.inference import compilation_cache

# JAX's flags are attributes of jax.config made at run time, which pylint cannot see.
# pylint: disable=no-member

_SRC = Path(__file__).resolve().parents[3] / "src"
_FLAGS = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size", "jax_enable_compilation_cache")


@pytest.fixture(name="no_jax_cache")
def _no_jax_cache():
  """JAX as a process without a cache folder sees it (this suite's own folder is put back afterwards)."""
  saved = {flag: getattr(jax.config, flag) for flag in _FLAGS}
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_compilation_cache_max_size", -1)
  jax.config.update("jax_enable_compilation_cache", True)
  yield
  for flag, value in saved.items():
    jax.config.update(flag, value)


def test_sets_creates_and_bounds_the_folder(no_jax_cache, tmp_path):  # pylint: disable=unused-argument
  folder = tmp_path / "a" / "b"
  assert compilation_cache.configure(str(folder)) == str(folder)
  assert folder.is_dir()
  assert jax.config.jax_compilation_cache_dir == str(folder)
  assert jax.config.jax_compilation_cache_max_size == compilation_cache.DEFAULT_MAX_BYTES


def test_expands_the_home_folder_and_keeps_a_size_limit_set_for_jax(no_jax_cache, tmp_path, monkeypatch):
  # pylint: disable=unused-argument
  monkeypatch.setenv("HOME", str(tmp_path))
  jax.config.update("jax_compilation_cache_max_size", 12345)
  assert compilation_cache.configure("~/cache") == str(tmp_path / "cache")
  assert jax.config.jax_compilation_cache_max_size == 12345


def test_an_empty_path_or_a_disabled_cache_sets_nothing(no_jax_cache, tmp_path):  # pylint: disable=unused-argument
  assert compilation_cache.configure("") is None
  assert jax.config.jax_compilation_cache_dir is None
  jax.config.update("jax_enable_compilation_cache", False)
  assert compilation_cache.configure(str(tmp_path / "c")) is None
  assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "c").exists()


def test_a_folder_jax_already_has_is_kept(no_jax_cache, tmp_path):  # pylint: disable=unused-argument
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
  assert compilation_cache.configure(str(tmp_path / "ours")) == str(tmp_path / "theirs")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs") and not (tmp_path / "ours").exists()


def test_bad_folders_name_the_config_key(no_jax_cache, tmp_path):  # pylint: disable=unused-argument
  (tmp_path / "file").write_text("x", encoding="utf-8")
  with pytest.raises(ConfigError, match=r"compilation_cache_dir='.*file': must be a folder; .*file is a file"):
    compilation_cache.configure(str(tmp_path / "file"))
  with pytest.raises(ConfigError, match=r"compilation_cache_dir='.*file/sub': cannot create the folder"):
    compilation_cache.configure(str(tmp_path / "file" / "sub"))
  with pytest.raises(ConfigError, match=r"compilation_cache_dir=3: must be a folder path"):
    compilation_cache.configure(3)
  assert jax.config.jax_compilation_cache_dir is None


_RUN = """
import json, sys
import jax
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
from maxtext.inference import LLM, SamplingParams
llm = LLM(model_name="llama-tiny", compilation_cache_dir=sys.argv[1], block_size=4, max_num_batched_tokens=16)
out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4))
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in out],
    "hits": hits.count("/jax/compilation_cache/cache_hits"),
    "folder": llm.engine.compilation_cache_dir,
}))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_step_programs_the_first_compiled(tmp_path):
  """Two runs of one model over one folder: the second one's compiles are cache hits, with the same tokens."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE")}
  env["PYTHONPATH"] = os.pathsep.join([str(_SRC)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny model's programs compile in well under 1 s
  folder = tmp_path / "cache"

  def run():
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(folder)], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])

  cold = run()
  assert cold["folder"] == str(folder) and cold["hits"] == 0
  assert any(folder.iterdir())
  warm = run()
  assert warm["hits"] > 0 and warm["tokens"] == cold["tokens"]
