"""docs/tpu-inference-kv-cache-spec.patch still applies to the released tpu-inference wheel's KV cache manager.

The wheel is fetched once into the cache dir (tests/conftest.py); `patch --dry-run` checks the hunks against the
unpacked `tpu_inference/runner/kv_cache_manager.py` (`.ci/run` installs `patch` where it is missing).
"""

import ast
import dataclasses
import enum
import logging
import pathlib
import shutil
import subprocess
import types

import jax.numpy as jnp
import numpy as np
import pytest

from support import tpu_inference_wheel
from maxtext.configs import load_config
from maxtext.kv_cache.kv_cache_spec_data import kv_cache_spec_data
from maxtext.kv_cache import kv_cache_layout

_PATCH = pathlib.Path(__file__).resolve().parents[3] / "docs" / "tpu-inference-kv-cache-spec.patch"


def _copy_target(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  target = dest / tpu_inference_wheel.KV_CACHE_MANAGER
  target.parent.mkdir(parents=True)
  shutil.copy(source / tpu_inference_wheel.KV_CACHE_MANAGER, target)
  return target


def _patch(directory: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
  if shutil.which("patch") is None:
    pytest.fail("the patch binary is missing: apt-get install -y patch (.ci/run does this)")
  with _PATCH.open("rb") as diff:
    return subprocess.run(
        ["patch", "--batch", "--fuzz=0", "-p1", "-d", str(directory), *flags],
        stdin=diff,
        capture_output=True,
        check=False,
    )


def test_the_patch_applies_cleanly_to_the_released_kv_cache_manager(tpu_inference_source, tmp_path):
  _copy_target(tpu_inference_source, tmp_path)
  done = _patch(tmp_path, "--dry-run")
  assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
  out = done.stdout.decode()
  assert "checking file tpu_inference/runner/kv_cache_manager.py" in out
  assert "FAILED" not in out and "offset" not in out and "fuzz" not in out, out


def test_the_patched_manager_is_valid_python_that_asks_the_model(tpu_inference_source, tmp_path):
  target = _copy_target(tpu_inference_source, tmp_path)
  done = _patch(tmp_path)
  assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
  tree = ast.parse(target.read_text())
  manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVCacheManager")
  methods = {n.name for n in manager.body if isinstance(n, ast.FunctionDef)}
  assert {"_add_jax_model_kv_cache_specs", "_pad_hybrid_page_sizes", "get_kv_cache_spec"} <= methods
  assert '"get_kv_cache_spec_data"' in target.read_text()


def test_a_patch_that_does_not_match_is_reported(tpu_inference_source, tmp_path):
  # The check can fail: against a manager missing the patched lines, patch refuses.
  target = _copy_target(tpu_inference_source, tmp_path)
  target.write_text(target.read_text().replace("kv_share_map = compute_kv_share_map(text_config)", "kv_share_map = {}"))
  assert _patch(tmp_path, "--dry-run").returncode != 0


# ---------------------------------------------------------------------------------------------------------------
# The patched methods run against the model's spec data: the methods are taken from the patched file as source and
# run with stand-ins for the vLLM / tpu-inference names they use (vLLM's spec classes as plain records, the
# runner's padding rules, the attention page size from this package's cache layout).


@dataclasses.dataclass
class _Spec:
  """vLLM's attention spec classes, as records of what the runner passes them."""

  block_size: int
  num_kv_heads: int
  head_size: int
  dtype: str
  page_size_padded: int | None = None
  sliding_window: int | None = None


class _FullAttentionSpec(_Spec):
  pass


class _SlidingWindowSpec(_Spec):
  pass


@dataclasses.dataclass
class _MambaSpec:
  block_size: int
  shapes: tuple
  dtypes: tuple
  page_size_padded: int | None = None
  mamba_type: object = None
  mamba_cache_mode: str = "none"

  @property
  def page_size_bytes(self) -> int:
    """vLLM's rule: the padded size when set, else the bytes of all state arrays of one slot."""
    if self.page_size_padded is not None:
      return self.page_size_padded
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes))


class _MambaBackend(enum.Enum):
  GDN_ATTN = "gdn"


def _attention_page_bytes(mesh, block_size, num_kv_heads, head_size, dtype, use_mla, backend):
  del mesh, use_mla, backend  # one device, no MLA, the default backend
  shape = kv_cache_layout.get_kv_cache_shape(1, block_size, num_kv_heads, head_size, dtype)
  return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def _patched_manager(source: pathlib.Path, tmp_path: pathlib.Path):
  """A class holding the patched spec methods, built from the patched file's source."""
  target = _copy_target(source, tmp_path)
  assert _patch(tmp_path).returncode == 0
  wanted = {"_create_attention_spec", "_pad_hybrid_page_sizes", "_add_jax_model_kv_cache_specs"}
  manager = next(n for n in ast.parse(target.read_text()).body if getattr(n, "name", "") == "KVCacheManager")
  methods = [n for n in manager.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
  assert {m.name for m in methods} == wanted
  module = ast.Module(body=[ast.ClassDef("Patched", [], [], methods, [])], type_ignores=[])
  names = {
      "KVCacheSpec": object,
      "FullAttentionSpec": _FullAttentionSpec,
      "SlidingWindowSpec": _SlidingWindowSpec,
      "MLAAttentionSpec": None,
      "MambaSpec": _MambaSpec,
      "MambaAttentionBackendEnum": _MambaBackend,
      "get_attention_page_size_bytes": _attention_page_bytes,
      "maybe_runner_slot_mamba_spec": lambda spec, vllm_config: spec,
      "common_utils": types.SimpleNamespace(
          get_padded_num_heads=kv_cache_layout.get_padded_num_heads,
          get_padded_head_dim=kv_cache_layout.get_padded_head_dim,
      ),
      "utils": types.SimpleNamespace(to_torch_dtype=np.dtype),
      "logger": logging.getLogger("patched_kv_cache_manager"),
  }
  exec(compile(ast.fix_missing_locations(module), str(target), "exec"), names)  # pylint: disable=exec-used
  return names["Patched"]


def _runner(max_model_len=64):
  cache_config = types.SimpleNamespace(block_size=16, mamba_block_size=None, mamba_cache_mode="none")
  return types.SimpleNamespace(
      cache_config=cache_config,
      model_config=types.SimpleNamespace(max_model_len=max_model_len),
      mesh=None,
      kv_cache_dtype="bfloat16",
      attention_backend=None,
      vllm_config=None,
  )


def _specs_for(cls, model_name, model_cnt):
  manager = cls()
  manager.runner = _runner()
  manager.use_mla = False
  manager.shared_kv_cache_layers = {}
  manager._hybrid_uniform_page_size_bytes = None  # pylint: disable=protected-access
  manager.compact_calls = []
  manager._maybe_set_compact_mamba_num_blocks_override = lambda *a: manager.compact_calls.append(a)  # pylint: disable=protected-access
  specs = {}
  data = kv_cache_spec_data(load_config(model_name=model_name, dtype="bfloat16"))
  manager._add_jax_model_kv_cache_specs(data, specs, model_cnt)  # pylint: disable=protected-access
  return manager, specs


def test_patched_runner_builds_mamba_and_padded_attention_specs_for_qwen3_5(tpu_inference_source, tmp_path):
  manager, specs = _specs_for(_patched_manager(tpu_inference_source, tmp_path), "qwen3.5-tiny", model_cnt=4)
  # Attention page: 16 tokens x 4 KV heads (2 padded to TP 4) x K,V x 128 lanes x 2 bytes = 32768.
  # GDN slot: conv 3 x 160 bf16 (960) + recurrent 4 x 16 x 24 fp32 (6144) = 7104.
  # 2 attention + 6 GDN layers: groups of 2, so 1 attention group + 3 GDN groups: 32768 + 3 * 7104 = 54080.
  assert {name: type(spec).__name__ for name, spec in specs.items()} == {
      f"layer.{i}": "_FullAttentionSpec" if i % 4 == 3 else "_MambaSpec" for i in range(8)
  }
  assert {spec.page_size_padded for spec in specs.values()} == {54080}
  assert manager.runner.cache_config.mamba_page_size_padded == 54080
  assert manager.compact_calls == [(32768, 7104, 2, 6)]
  gdn = specs["layer.0"]
  assert (gdn.shapes, gdn.dtypes, gdn.mamba_type, gdn.block_size) == (
      ((3, 160), (4, 16, 24)),
      (np.dtype("bfloat16"), np.dtype("float32")),
      _MambaBackend.GDN_ATTN,
      64,  # no mamba_block_size set: one block covers max_model_len
  )
  attn = specs["layer.3"]
  assert (attn.num_kv_heads, attn.head_size, attn.block_size, attn.sliding_window) == (4, 128, 16, None)


def test_patched_runner_keeps_sliding_windows_and_kv_share_targets(tpu_inference_source, tmp_path):
  manager, specs = _specs_for(_patched_manager(tpu_inference_source, tmp_path), "kvshare-tiny", model_cnt=1)
  assert sorted(specs) == ["layer.0", "layer.1", "layer.2", "layer.3"]
  assert [type(specs[f"layer.{i}"]).__name__ for i in range(4)] == [
      "_SlidingWindowSpec",
      "_SlidingWindowSpec",
      "_FullAttentionSpec",
      "_SlidingWindowSpec",
  ]
  assert specs["layer.0"].sliding_window == 8
  assert manager.shared_kv_cache_layers == {"layer.4": "layer.3", "layer.5": "layer.2"}
  # Not hybrid: no uniform padding, each spec carries its own page size (16 x 2 x 2 x 128 x 2 bytes).
  assert not manager.compact_calls
  assert {spec.page_size_padded for spec in specs.values()} == {16384}
