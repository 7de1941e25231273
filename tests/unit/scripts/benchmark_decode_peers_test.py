"""scripts/benchmark_decode_peers.py's pure helpers (its workers run in tests/unit/scripts/benchmark_decode_test.py)."""

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_decode_peers.py"


def _load_peers():
  spec = importlib.util.spec_from_file_location("benchmark_decode_peers", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
    "variant, overrides, peer",
    [
        ("float32", (), "maxtext"),
        ("bfloat16", ("weight_dtype=bfloat16",), "maxtext:bfloat16"),
        ("int8w", ("weight_dtype=bfloat16", "quantization=int8w"), "maxtext:int8w"),
        ("dtype=bfloat16", ("dtype=bfloat16",), "maxtext:dtype=bfloat16"),
    ],
)
def test_a_variant_is_a_named_override_or_a_key_value(variant, overrides, peer):
  peers = _load_peers()
  assert peers.variant_overrides(variant) == overrides and peers.variant_peer(variant) == peer


@pytest.mark.parametrize("variant", ["float16", "=bfloat16", ""])
def test_a_variant_that_is_neither_is_refused_with_the_names(variant):
  with pytest.raises(ValueError, match=r"one of \['bfloat16', 'float32', 'int8w'\] or key=value, got"):
    _load_peers().variant_overrides(variant)


def test_random_prompts_are_seeded_and_inside_the_vocabulary():
  peers = _load_peers()
  prompts = peers.random_prompts(40, 3, 5, seed=1)
  assert prompts == peers.random_prompts(40, 3, 5, seed=1) != peers.random_prompts(40, 3, 5, seed=2)
  assert len(prompts) == 3 and all(len(p) == 5 and all(3 <= t < 40 for t in p) for p in prompts)
