"""Tests of the whole-executable cache of step programs: a stored program runs like the traced one without a
trace, keys follow what shapes a program, unusable entries are misses; and two engine processes, the second of
which traces nothing."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.configs import load_config
from maxtext.inference import step_programs
from maxtext.kernels.backend import get_backend
from maxtext.kernels.cpu import cpu_gemm

SRC = pathlib.Path(__file__).resolve().parents[3] / "src"


def _step(params, caches, x, layer_map):
  """A step's shape: parameters, donated caches, a batch array and a static map."""
  scale = float(len(layer_map))
  return [c + x.sum() for c in caches], jnp.tanh(x @ params[0]) * scale


def _jitted(trace_counter):
  def counted(*args):
    trace_counter.append(1)
    return _step(*args)

  return jax.jit(counted, donate_argnums=(1,), static_argnums=(3,))


def _args(rows=2):
  params = [jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)]
  caches = [jnp.zeros((4,), jnp.float32), jnp.ones((4,), jnp.float32)]
  x = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8) / 10
  return params, caches, x, (("layer.0", 0), ("layer.1", 1))


def _program(folder, traces, run_key=None):
  cache = step_programs.ProgramCache(folder, run_key or {"run": 1})
  return step_programs.StepProgram(_jitted(traces), "step", {}, cache)


def test_a_stored_program_runs_like_the_traced_one_without_a_trace(tmp_path):
  traces = []
  first = _program(tmp_path, traces)
  expected_caches, expected = first(*_args())
  assert (first.compiled, first.loaded, len(traces)) == (1, 0, 1)
  assert len(list(tmp_path.glob("*" + step_programs.SUFFIX))) == 1
  second = _program(tmp_path, traces)  # a later start: a new program object over the same folder
  caches, out = second(*_args())
  assert (second.compiled, second.loaded, len(traces)) == (0, 1, 1)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
  for got, want in zip(caches, expected_caches, strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  second(*_args())  # the same shapes again: the executable in memory
  assert second.loaded == 1 and second.compiled == 0


def test_the_caches_are_donated_as_by_the_jitted_function(tmp_path):
  _program(tmp_path, [])(*_args())
  params, caches, x, layer_map = _args()
  _program(tmp_path, [])(params, caches, x, layer_map)
  assert all(c.is_deleted() for c in caches) and not params[0].is_deleted()


def test_another_shape_or_run_key_or_name_is_another_program(tmp_path):
  traces = []
  _program(tmp_path, traces)(*_args(rows=2))
  _program(tmp_path, traces)(*_args(rows=4))  # another batch bucket
  _program(tmp_path, traces, run_key={"run": 2})(*_args(rows=2))  # another model, config or package
  assert len(traces) == 3 and len(list(tmp_path.glob("*" + step_programs.SUFFIX))) == 3
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  signature = step_programs.signature(_args()[2:3])
  paths = {
      cache.path_for("step", {}, signature),
      cache.path_for("step_greedy", {}, signature),
      cache.path_for("step", {"xla_cpu_experimental_ynn_fusion_type": ""}, signature),
  }
  assert len(paths) == 3


@pytest.mark.parametrize("content", [b"", b"not a pickle", None])
def test_an_unusable_entry_is_a_logged_miss_that_is_compiled_again(tmp_path, caplog, content):
  traces = []
  _program(tmp_path, traces)(*_args())
  (path,) = tmp_path.glob("*" + step_programs.SUFFIX)
  if content is None:  # a pickle of the right shape holding bytes that are no executable
    import pickle  # pylint: disable=import-outside-toplevel  # only this case writes one

    tree = jax.tree_util.tree_structure(([0, 0], 0))
    content = pickle.dumps((b"\x00" * 64, tree, tree))
  path.write_bytes(content)
  again = _program(tmp_path, traces)
  _, out = again(*_args())
  assert again.compiled == 1 and again.loaded == 0 and len(traces) == 2 and out.shape == (2, 8)
  assert "is unusable" in caplog.text
  assert _program(tmp_path, traces)(*_args()) and len(traces) == 2  # rewritten whole: loaded again


def test_a_run_lists_its_programs_most_recently_used_first(tmp_path):
  _program(tmp_path, [])(*_args(rows=2))
  _program(tmp_path, [])(*_args(rows=4))
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  two, four = (cache.path_for("step", {}, step_programs.signature(_args(rows)[2:3])) for rows in (2, 4))
  assert cache.recent() == [four, two]
  _program(tmp_path, [])(*_args(rows=2))  # a later start uses the 2-row program: it comes first
  assert cache.recent() == [two, four]
  assert step_programs.ProgramCache(tmp_path, {"run": 2}).recent() == []  # another run has a list of its own


def test_preloaded_programs_are_taken_without_reading_their_files_again(tmp_path):
  traces = []
  expected = np.asarray(_program(tmp_path, traces)(*_args())[1])
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  assert cache.preload() == 1
  for path in tmp_path.glob("*" + step_programs.SUFFIX):
    path.unlink()  # what a later call gets must be the preloaded executable
  program = step_programs.StepProgram(_jitted(traces), "step", {}, cache)
  np.testing.assert_array_equal(np.asarray(program(*_args())[1]), expected)
  assert (program.loaded, program.compiled, len(traces)) == (1, 0, 1)


def test_preloading_skips_what_it_cannot_use(tmp_path):
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  assert cache.preload() == 0  # no list yet
  _program(tmp_path, [])(*_args())
  (path,) = tmp_path.glob("*" + step_programs.SUFFIX)
  path.write_bytes(b"not a pickle")
  assert cache.preload() == 0 and not path.exists()  # an unusable entry: removed, then compiled when called
  traces = []
  program = step_programs.StepProgram(_jitted(traces), "step", {}, cache)
  program(*_args())
  assert (program.loaded, program.compiled) == (0, 1)
  (tmp_path / (cache.digest[:40] + step_programs.RECENT_SUFFIX)).write_text("{not json", encoding="utf-8")
  assert cache.recent() == [] and cache.preload() == 0


def test_a_program_loaded_for_another_call_structure_is_a_miss(tmp_path, caplog):
  _program(tmp_path, [])(*_args())
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  (path,) = tmp_path.glob("*" + step_programs.SUFFIX)
  assert cache.load(path, jax.tree_util.tree_structure(((0, 0), {}))) is None
  assert "another call structure" in caplog.text


def test_a_program_that_came_from_jaxs_cache_is_not_kept(tmp_path, monkeypatch):
  # What JAX's monitoring reports when a compile was a hit in its persistent cache.
  traces = []
  program = _program(tmp_path, traces)
  real = jax.stages.Lowered.compile

  def hit_then_compile(self, *args, **kwargs):
    step_programs._count_cache_hit("/jax/compilation_cache/cache_hits")  # pylint: disable=protected-access
    return real(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", hit_then_compile)
  program(*_args())
  assert program.compiled == 1 and not list(tmp_path.glob("*" + step_programs.SUFFIX))


def test_run_key_drops_the_run_options_and_keeps_the_model_and_backend():
  class Backend:
    """A backend with one option."""

    name = "cpu"

    def __init__(self, panels):
      self.weight_panels = panels

  cfg = load_config(model_name="llama-tiny")
  base = step_programs.run_key(cfg, Backend(True), _args()[:2], {"layer.0": 0})
  prompt = step_programs.run_key(
      load_config(model_name="llama-tiny", prompt="x", background_compile=False),
      Backend(True),
      _args()[:2],
      {"layer.0": 0},
  )
  assert prompt == base
  assert (
      step_programs.run_key(
          load_config(model_name="llama-tiny", block_size=8), Backend(True), _args()[:2], {"layer.0": 0}
      )
      != base
  )
  assert step_programs.run_key(cfg, Backend(False), _args()[:2], {"layer.0": 0}) != base
  assert step_programs.run_key(cfg, Backend(True), _args()[:2], {"layer.0": 1}) != base
  assert step_programs.run_key(cfg, Backend(True), _args()[:2], {"layer.0": 0}, kernels=False) != base
  assert base["package"] == step_programs.package_digest() and base["host"] == step_programs.host_digest()


def test_programs_are_named_after_the_run_key_so_jaxs_cache_keys_differ(tmp_path):
  one, two = step_programs.ProgramCache(tmp_path, {"run": 1}), step_programs.ProgramCache(tmp_path, {"run": 2})
  assert one.program_name("step") != two.program_name("step") and one.program_name("step").startswith("step_")
  lowered = jax.jit(step_programs.named(lambda x: x + 1, one.program_name("step"))).lower(jnp.ones(2))
  assert one.program_name("step") in lowered.as_text()  # the module's name, which JAX's cache key hashes


def test_prune_removes_the_least_recently_used_programs(tmp_path):
  cache = step_programs.ProgramCache(tmp_path, {"run": 1})
  for i, name in enumerate(("old", "mid", "new")):
    (tmp_path / (name + step_programs.SUFFIX)).write_bytes(b"x" * 100)
    os.utime(tmp_path / (name + step_programs.SUFFIX), (i + 1, i + 1))
  assert cache.prune(max_bytes=250) == [tmp_path / ("old" + step_programs.SUFFIX)]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["mid.program", "new.program"]


def test_the_folder_is_the_configs_own_compilation_cache_only(tmp_path):
  cfg = load_config(model_name="llama-tiny", compilation_cache_dir=str(tmp_path / "cc"))
  assert step_programs.folder_for(cfg, str(tmp_path / "cc")) == tmp_path / "cc" / step_programs.FOLDER_NAME
  assert step_programs.folder_for(cfg, str(tmp_path / "elsewhere")) is None  # JAX was given another folder
  assert step_programs.folder_for(cfg, None) is None  # JAX caches nothing
  off = load_config(model_name="llama-tiny", compilation_cache_dir="")
  assert step_programs.folder_for(off, str(tmp_path / "cc")) is None


_ENGINE_RUN = """
import json, sys
from maxtext.configs import load_config
from maxtext.inference.engine import LLMEngine
from maxtext.inference import SamplingParams
cfg = load_config(model_name="llama-tiny", compilation_cache_dir=sys.argv[1], max_target_length=32,
                  max_num_batched_tokens=16, min_token_bucket=16)
engine = LLMEngine(cfg)
rid = engine.add_request([1, 5, 9, 3], SamplingParams(max_tokens=4, temperature=0.0))
tokens = None
while engine.has_unfinished_requests():
  for finished in engine.step():
    tokens = list(finished.output_token_ids)
print(json.dumps({"tokens": tokens, "traces": engine.stats.step_traces}))
"""


@pytest.mark.slow  # two fresh interpreters import JAX; the first compiles
def test_a_second_engine_process_traces_no_step_and_decodes_alike(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
  runs = []
  for _ in range(2):
    result = subprocess.run(
        [sys.executable, "-c", _ENGINE_RUN, str(tmp_path / "cc")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
  assert runs[0]["traces"] >= 1 and runs[1]["traces"] == 0
  assert runs[1]["tokens"] == runs[0]["tokens"] and len(runs[0]["tokens"]) == 4
  assert list((tmp_path / "cc" / step_programs.FOLDER_NAME).glob("*" + step_programs.SUFFIX))


def test_the_backends_say_whether_their_kernels_are_loaded_before_a_program_is():
  # A stored program calls the C++ kernels by name: the engine asks the backend to register them first.
  assert get_backend("reference").load_kernels() is None
  assert get_backend("cpu").load_kernels() is (cpu_gemm.unsupported_reason() is None)
