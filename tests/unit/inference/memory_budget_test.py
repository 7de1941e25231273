"""The memory check: the parameters', caches' and activations' bytes from the config alone, the available memory,
the refusal."""

import logging
import pathlib
import resource

import pytest
from flax import nnx

from maxtext.configs import ConfigError, load_config
from maxtext.inference import LLM, memory_budget
from maxtext.kernels.cpu import cpu_gemm
from maxtext.models import Transformer, get_flat_params

TINY = {"model_name": "qwen3-next-tiny"}  # 2.5 MiB of float32 parameters, 16.4 MiB of caches (README's dry run)
FIXTURES = pathlib.Path(__file__).parent / "memory_fixtures"

# llama-tiny by hand (configs/models/llama-tiny.yml): D=64, 4 layers, 4 query / 2 KV heads of 16, MLP 128, vocab 512,
# an untied head.
_LAYER_KERNELS = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o; gate, up, down: 36864
_NORMS = 4 * 2 * 64 + 64  # two RMSNorm scales a layer, the final one: 576
LLAMA_TINY_WEIGHTS = 512 * 64 + 4 * _LAYER_KERNELS + _NORMS + 64 * 512  # embedding, layers, norms, head: 213568


def _int8_panel_bytes(k: int, n: int) -> int:
  # A [K, N] kernel in int8 panels: a 32 x 32 block of int8 weights and 32 float32 scales per 32 rows and columns.
  return (k // 32) * (n // 32) * (32 * 32 + 32 * 4)


def test_param_bytes_are_those_of_the_built_model():
  for weight_dtype in ("float32", "bfloat16"):
    cfg = load_config(model_name="llama-tiny", weight_dtype=weight_dtype)
    built = Transformer(cfg, rngs=nnx.Rngs(0))
    assert memory_budget.param_bytes(cfg) == sum(a.nbytes for a in get_flat_params(built).values())


def test_the_figures_of_a_tiny_model_are_those_counted_by_hand():
  cfg = load_config(model_name="llama-tiny", kernel_backend="reference")
  need = memory_budget.memory_need(cfg)
  assert LLAMA_TINY_WEIGHTS == 213568
  assert (need.load_param_bytes, need.kept_param_bytes) == (4 * 213568, 4 * 213568)
  # 256 blocks of 16 tokens, keys and values of 2 KV heads each padded from 16 to 128 lanes, float32, 4 layers.
  assert need.cache_bytes == 256 * 16 * (2 * 2) * 128 * 4 * 4 == 33554432
  # A 256-token step: 4 x [T, 64], the projections [T, (2 x 4 + 2 x 2) x 16], 3 x [T, 128], in float32; the logits
  # and their log-softmax of 8 request rows, [8, 512] float32 each.
  assert need.activation_bytes == 256 * (4 * 64 + 12 * 16 + 3 * 128) * 4 + 2 * 8 * 512 * 4 == 884736
  assert need.total_bytes == 854272 + 33554432 + 884736
  bf16 = memory_budget.memory_need(load_config(model_name="llama-tiny", weight_dtype="bfloat16"))
  assert bf16.load_param_bytes == 2 * 213568
  smaller_steps = load_config(model_name="llama-tiny", max_num_batched_tokens=100, max_num_seqs=2)
  assert memory_budget.activation_bytes(smaller_steps) == 128 * 832 * 4 + 2 * 8 * 512 * 4  # 100 -> bucket 128


@pytest.mark.skipif(not cpu_gemm.load(), reason="the cpu kernels are not available here")
def test_int8w_weights_are_counted_as_kept():
  cfg = load_config(model_name="llama-tiny", weight_dtype="bfloat16", quantization="int8w", kernel_backend="cpu")
  need = memory_budget.memory_need(cfg)
  layer = sum(_int8_panel_bytes(k, n) for k, n in ((64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128)))
  layer += _int8_panel_bytes(128, 64)  # down
  # The embedding table and the norms stay bfloat16; every layer kernel and the head go to int8 panels, and the
  # embedding gets an int8 copy of its table for a tied head.
  kept = 512 * 64 * 2 + _NORMS * 2 + 4 * layer + _int8_panel_bytes(64, 512) + _int8_panel_bytes(64, 512)
  assert (need.load_param_bytes, need.kept_param_bytes) == (2 * 213568, kept) == (427136, 306304)
  # The load holds the bfloat16 form whole before it is laid out, and the re-laid tensors in both forms at the peak.
  assert need.relaid_param_bytes == 4 * layer + 2 * _int8_panel_bytes(64, 512)
  assert need.param_bytes == 427136 + need.relaid_param_bytes


def test_the_tiny_hybrid_models_figures_are_the_dry_runs():
  need = memory_budget.memory_need(load_config(**TINY))
  assert (need.load_param_bytes, need.cache_bytes, need.activation_bytes) == (2581760, 17212672, 1081344)
  # What the cpu backend re-lays, counted on the abstract model, is what it re-lays on the built one.
  assert need.relaid_param_bytes == LLM(**TINY).engine.prepared_bytes == 1376256
  assert need.param_bytes == 2581760 + 1376256 and need.total_bytes == 22252032


def test_the_environment_variable_overrides_and_is_checked():
  assert memory_budget.available_memory({"MAXTEXT_MEMORY_LIMIT_BYTES": " 1234 "}) == (1234, "MAXTEXT_MEMORY_LIMIT_BYTES")
  for bad in ("abc", "0", "-5", "1e9"):
    with pytest.raises(ConfigError, match=rf"MAXTEXT_MEMORY_LIMIT_BYTES='{bad}': must be a positive number of bytes"):
      memory_budget.available_memory({"MAXTEXT_MEMORY_LIMIT_BYTES": bad})


def _fixture(name: str) -> str | None:
  path = FIXTURES / name
  return path.read_text(encoding="ascii") if path.exists() else None


def test_the_cgroup_files_are_read_v2_and_v1():
  current = _fixture("cgroup_v2_memory.current")
  assert memory_budget.cgroup_room(_fixture("cgroup_v2_memory.max"), current) is None  # "max"
  assert memory_budget.cgroup_room(_fixture("cgroup_v2_limited_memory.max"), current) == (4 << 30) - (1 << 30)
  usage = _fixture("cgroup_v1_memory.usage_in_bytes")
  assert memory_budget.cgroup_room(_fixture("cgroup_v1_memory.limit_in_bytes"), usage) is None  # v1's "no limit"
  assert memory_budget.cgroup_room(_fixture("cgroup_v1_limited_memory.limit_in_bytes"), usage) == (2 << 30) - (1 << 29)
  assert memory_budget.cgroup_room(_fixture("cgroup_v2_limited_memory.max"), None) == 4 << 30  # use unreadable
  assert memory_budget.cgroup_room(None, None) is None
  assert memory_budget.cgroup_room("1000\n", "5000\n") == 0  # over its limit: nothing left


def test_mem_available_and_the_address_space_limit_are_read():
  assert memory_budget.meminfo_available(_fixture("meminfo")) == 23382544 * 1024
  assert memory_budget.meminfo_available(_fixture("meminfo_old_kernel")) is None
  assert memory_budget.meminfo_available(None) is None
  status = _fixture("status")
  assert memory_budget.address_space_room(4 << 30, status) == (4 << 30) - 1516800 * 1024
  assert memory_budget.address_space_room(resource.RLIM_INFINITY, status) is None
  assert memory_budget.address_space_room(1 << 20, status) == 0
  assert memory_budget.address_space_room(4 << 30, "Name:\tpython\n") == 4 << 30


@pytest.mark.parametrize(
    "cgroup, meminfo, rlimit, expected",
    [
        (("max\n", "5\n"), "MemTotal: 100 kB\nMemAvailable:   2000 kB\n", None, (2048000, "MemAvailable in {meminfo}")),
        (
            ("1024000\n", "1000\n"),
            "MemAvailable: 2000 kB\n",
            None,
            (1023000, "the cgroup limit {limit} less its use"),
        ),
        (("1024000\n", None), "MemAvailable: 2000 kB\n", None, (1024000, "the cgroup limit {limit} less its use")),
        (("4096000\n", "0\n"), "MemAvailable:   2000 kB\n", None, (2048000, "MemAvailable in {meminfo}")),
        (
            ("4096000\n", "0\n"),
            "MemAvailable:   2000 kB\n",
            1516800 * 1024 + 1000,
            (1000, "RLIMIT_AS less the process's VmSize"),
        ),
        ((None, None), None, None, None),
    ],
)
def test_the_available_memory_is_the_smallest_of_the_cgroups_room_the_address_space_and_mem_available(
    tmp_path, monkeypatch, cgroup, meminfo, rlimit, expected
):
  paths = {"limit": tmp_path / "memory.max", "usage": tmp_path / "memory.current", "meminfo": tmp_path / "meminfo"}
  for key, text in (("limit", cgroup[0]), ("usage", cgroup[1]), ("meminfo", meminfo)):
    if text is not None:
      paths[key].write_text(text, encoding="ascii")
  monkeypatch.setattr(memory_budget, "_CGROUP_FILES", ((str(paths["limit"]), str(paths["usage"])),))
  monkeypatch.setattr(memory_budget, "_MEMINFO", str(paths["meminfo"]))
  monkeypatch.setattr(memory_budget, "_PROC_STATUS", str(FIXTURES / "status"))
  limit = resource.RLIM_INFINITY if rlimit is None else rlimit
  monkeypatch.setattr(memory_budget.resource, "getrlimit", lambda _: (limit, resource.RLIM_INFINITY))
  found = memory_budget.available_memory({})
  assert found == (None if expected is None else (expected[0], expected[1].format(**paths)))


def test_a_run_that_cannot_fit_is_refused_with_the_figures_and_what_to_change():
  cfg = load_config(**TINY)
  with pytest.raises(memory_budget.InsufficientMemoryError) as raised:
    memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "15000000"})
  assert str(raised.value) == (
      "model_name=qwen3-next-tiny needs 21.22 MiB (parameters 3.77 MiB: float32, random, no checkpoint; KV caches"
      " 16.42 MiB; activations 1.03 MiB) but 14.31 MiB is available (MAXTEXT_MEMORY_LIMIT_BYTES); use a KV cache"
      " within the 9.50 MiB left (kv_cache_memory_bytes=9960640 or less, with a max_target_length it holds; fewer"
      " max_num_seqs for recurrent states); memory_check=false runs it anyway"
  )
  assert 15000000 - (2581760 + 1376256) - 1081344 == 9960640
  assert isinstance(raised.value, ConfigError)  # the CLI's one-line error, exit 2
  with pytest.raises(memory_budget.InsufficientMemoryError, match=r"use weight_dtype=bfloat16 \(parameters 1.89 MiB\)"):
    memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "2000000"})
  assert memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "22252032"}).total_bytes == 22252032
  bf16 = load_config(**TINY, weight_dtype="bfloat16")
  with pytest.raises(memory_budget.InsufficientMemoryError, match=r"\); use a smaller model; memory_check=false"):
    memory_budget.check_fits(bf16, {"MAXTEXT_MEMORY_LIMIT_BYTES": "2000000"})


def test_memory_check_false_runs_a_run_that_does_not_fit():
  cfg = load_config(**TINY, memory_check=False)
  assert memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "1000"}).total_bytes == 22252032


def test_random_weights_above_the_threshold_are_warned_about(monkeypatch, caplog):
  cfg = load_config(**TINY)
  enough = {"MAXTEXT_MEMORY_LIMIT_BYTES": str(10**12)}
  with caplog.at_level(logging.WARNING, logger=memory_budget.__name__):
    memory_budget.check_fits(cfg, enough)
    assert not caplog.records  # 2.5 MiB: below 1 GiB
    monkeypatch.setattr(memory_budget, "RANDOM_WEIGHTS_WARNING_BYTES", 1_000_000)
    memory_budget.check_fits(cfg, enough)
  (record,) = caplog.records
  assert record.levelno == logging.WARNING
  assert record.getMessage().startswith("model_name=qwen3-next-tiny names no checkpoint: building 2.46 MiB of random")


def test_the_engine_refuses_before_it_allocates(monkeypatch):
  monkeypatch.setenv("MAXTEXT_MEMORY_LIMIT_BYTES", "15000000")
  with pytest.raises(memory_budget.InsufficientMemoryError, match="needs 21.22 MiB"):
    LLM(**TINY)


def test_checkpoint_files_count_the_gguf_file_or_the_folders_safetensors(tmp_path):
  (tmp_path / "model-1.safetensors").write_bytes(b"x" * 100)
  (tmp_path / "model-2.safetensors").write_bytes(b"x" * 50)
  (tmp_path / "config.json").write_bytes(b"{}" * 40)
  gguf = tmp_path / "m.gguf"
  gguf.write_bytes(b"x" * 70)
  keys = {"gguf_model_path": "", "hf_model_path": "", "load_parameters_path": ""}
  assert memory_budget.checkpoint_file_bytes({**keys, "hf_model_path": str(tmp_path)}) == 150
  assert memory_budget.checkpoint_file_bytes({**keys, "gguf_model_path": str(gguf)}) == 70
  assert memory_budget.checkpoint_file_bytes({**keys, "gguf_model_path": str(tmp_path / "missing.gguf")}) == 0
  orbax = {**keys, "hf_model_path": str(tmp_path), "load_parameters_path": "/ckpt"}  # read into arrays, not mapped
  assert memory_budget.checkpoint_file_bytes(orbax) == 0 and memory_budget.checkpoint_file_bytes(keys) == 0
  need = memory_budget.MemoryNeed(1000, 800, 10, 1, relaid_param_bytes=300, checkpoint_file_bytes=500)
  assert need.param_bytes == 1000 + 500 and need.total_bytes == 1511  # the larger transient over the larger form
