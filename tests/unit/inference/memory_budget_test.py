"""The memory check: the parameters' and caches' bytes from the config alone, the available memory, the refusal."""

import logging

import pytest
from flax import nnx

from maxtext.configs import ConfigError, load_config
from maxtext.inference import LLM, memory_budget
from maxtext.models import Transformer, get_flat_params

TINY = {"model_name": "qwen3-next-tiny"}  # 2.6 MB of float32 parameters, 17.2 MB of caches (README's dry run)


def test_param_bytes_are_those_of_the_built_model():
  for weight_dtype in ("float32", "bfloat16"):
    cfg = load_config(model_name="llama-tiny", weight_dtype=weight_dtype)
    built = Transformer(cfg, rngs=nnx.Rngs(0))
    assert memory_budget.param_bytes(cfg) == sum(a.nbytes for a in get_flat_params(built).values())


def test_the_tiny_hybrid_models_figures_are_the_dry_runs():
  need = memory_budget.memory_need(load_config(**TINY))
  assert (need.param_bytes, need.cache_bytes, need.total_bytes) == (2581760, 17212672, 19794432)


def test_the_environment_variable_overrides_and_is_checked():
  assert memory_budget.available_memory({"MAXTEXT_MEMORY_LIMIT_BYTES": " 1234 "}) == (1234, "MAXTEXT_MEMORY_LIMIT_BYTES")
  for bad in ("abc", "0", "-5", "1e9"):
    with pytest.raises(ConfigError, match=rf"MAXTEXT_MEMORY_LIMIT_BYTES='{bad}': must be a positive number of bytes"):
      memory_budget.available_memory({"MAXTEXT_MEMORY_LIMIT_BYTES": bad})


@pytest.mark.parametrize(
    "cgroup, meminfo, expected",
    [
        (("max\n", "5\n"), "MemTotal: 100 kB\nMemAvailable:   2000 kB\n", (2048000, "MemAvailable in {meminfo}")),
        (
            ("1024000\n", "1000\n"),
            "MemAvailable: 2000 kB\n",
            (1023000, "the cgroup limit {limit} less 1000 bytes in use"),
        ),
        (("1024000\n", None), "MemAvailable: 2000 kB\n", (1024000, "the cgroup limit {limit} less 0 bytes in use")),
        (("4096000\n", "0\n"), "MemAvailable:   2000 kB\n", (2048000, "MemAvailable in {meminfo}")),
        ((None, None), None, None),
    ],
)
def test_the_available_memory_is_the_smaller_of_the_cgroups_room_and_mem_available(
    tmp_path, monkeypatch, cgroup, meminfo, expected
):
  paths = {"limit": tmp_path / "memory.max", "usage": tmp_path / "memory.current", "meminfo": tmp_path / "meminfo"}
  for key, text in (("limit", cgroup[0]), ("usage", cgroup[1]), ("meminfo", meminfo)):
    if text is not None:
      paths[key].write_text(text, encoding="ascii")
  monkeypatch.setattr(memory_budget, "_CGROUP_FILES", ((str(paths["limit"]), str(paths["usage"])),))
  monkeypatch.setattr(memory_budget, "_MEMINFO", str(paths["meminfo"]))
  found = memory_budget.available_memory({})
  assert found == (None if expected is None else (expected[0], expected[1].format(**paths)))


def test_a_run_that_cannot_fit_is_refused_with_the_figures_and_what_to_change():
  cfg = load_config(**TINY)
  with pytest.raises(memory_budget.InsufficientMemoryError) as raised:
    memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "15000000"})
  assert str(raised.value) == (
      "model_name=qwen3-next-tiny needs 19.8 MB (2.6 MB of float32 parameters, random, no checkpoint, + 17.2 MB of"
      " KV caches) but 15.0 MB is available (MAXTEXT_MEMORY_LIMIT_BYTES); use KV caches within 12.4 MB: a smaller"
      " kv_cache_memory_bytes, num_kv_blocks, max_target_length or max_num_seqs"
  )
  assert isinstance(raised.value, ConfigError)  # the CLI's one-line error, exit 2
  with pytest.raises(memory_budget.InsufficientMemoryError, match=r"use weight_dtype=bfloat16 \(parameters 1.3 MB\)"):
    memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "2000000"})
  assert memory_budget.check_fits(cfg, {"MAXTEXT_MEMORY_LIMIT_BYTES": "19794432"}).total_bytes == 19794432


def test_random_weights_above_the_threshold_are_warned_about(monkeypatch, caplog):
  cfg = load_config(**TINY)
  enough = {"MAXTEXT_MEMORY_LIMIT_BYTES": str(10**12)}
  with caplog.at_level(logging.WARNING, logger=memory_budget.__name__):
    memory_budget.check_fits(cfg, enough)
    assert not caplog.records  # 2.6 MB: below 1 GiB
    monkeypatch.setattr(memory_budget, "RANDOM_WEIGHTS_WARNING_BYTES", 1_000_000)
    memory_budget.check_fits(cfg, enough)
  (record,) = caplog.records
  assert record.getMessage().startswith("model_name=qwen3-next-tiny names no checkpoint: building 2.6 MB of random")


def test_the_engine_refuses_before_it_allocates(monkeypatch):
  monkeypatch.setenv("MAXTEXT_MEMORY_LIMIT_BYTES", "15000000")
  with pytest.raises(memory_budget.InsufficientMemoryError, match="needs 19.8 MB"):
    LLM(**TINY)
