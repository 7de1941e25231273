"""The replica's KV-cache groups against vLLM 0.32.0's own grouping functions, for every family of the tier.

The replica's per-layer specs become vLLM's (`FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec` with its page
padded to the attention page, as the spec patch pads it) and go through the functions vLLM's `get_kv_cache_groups`
dispatches to: one group for a uniform spec or a uniform type, else `_get_kv_cache_groups_uniform_page_size`. No
engine runs: the folders are the references' (built once per session).
"""

from __future__ import annotations

import pytest
import torch

import cases

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _vllm_specs(cfg) -> dict:
  """vLLM's spec for every layer that owns a cache, in layer order."""
  # pylint: disable=import-outside-toplevel  # imported in the test process, after the tier's environment is set
  from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

  from maxtext.kv_cache import kv_cache_spec

  ours = kv_cache_spec.get_kv_cache_specs(cfg)
  out, page = {}, None
  for name in sorted(ours, key=lambda n: int(n.split(".")[1])):
    spec = ours[name]
    if spec.cache_kind != "attention":
      continue
    common = {"block_size": spec.block_size, "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_dim}
    if spec.sliding_window:
      out[name] = SlidingWindowSpec(**common, dtype=_DTYPES[spec.dtype], sliding_window=spec.sliding_window)
    else:
      out[name] = FullAttentionSpec(**common, dtype=_DTYPES[spec.dtype])
    page = out[name].page_size_bytes
  for name, spec in ours.items():
    if spec.cache_kind == "recurrent":
      dtypes = tuple(_DTYPES[d] for d in spec.state_dtypes)
      out[name] = MambaSpec(
          block_size=int(cfg.block_size), shapes=tuple(spec.state_shapes), dtypes=dtypes, page_size_padded=page
      )
  return dict(sorted(out.items(), key=lambda kv: int(kv[0].split(".")[1])))


def _vllm_groups(specs: dict) -> list[list[str]]:
  """Groups as `get_kv_cache_groups` forms them for these specs (the hybrid KV-cache manager on)."""
  # pylint: disable=import-outside-toplevel  # see above
  from vllm.v1.core import kv_cache_planning as planning
  from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

  if planning.is_kv_cache_spec_uniform(specs) or UniformTypeKVCacheSpecs.from_specs(specs):
    return [list(specs)]
  # pylint: disable=protected-access  # vLLM's own rule for mixed layer kinds, the function under comparison
  return [list(g.layer_names) for g in planning._get_kv_cache_groups_uniform_page_size(specs)]


_CASES = [(case, {}) for case in cases.FAMILIES] + [("gemma3_kv_sharing", dict(cases.KV_SHARING["maxtext_config"]))]
_CASES += [(case, {}) for case in cases.LONG]


@pytest.mark.parametrize("case, overrides", _CASES, ids=[case for case, _ in _CASES])
def test_the_replicas_groups_are_vllms(case, overrides, references):
  # pylint: disable=import-outside-toplevel  # see above
  from maxtext.checkpoint import load_run_config
  from maxtext.inference.engine_build import make_kv_cache_manager

  cfg = load_run_config(hf_model_path=references[case]["folder"], kernel_backend="reference", **overrides)
  manager = make_kv_cache_manager(cfg)
  specs = _vllm_specs(cfg)
  owned = [[name for name in g.layer_names if name in specs] for g in manager.groups]
  assert owned == _vllm_groups(specs)


@pytest.mark.parametrize(
    "pattern",
    ["sssssf" * 2, "ssfssf", "sfsf", "ssfssfs", "sf" * 12 + "f", "sssssf" * 8],
)
def test_vllms_rule_on_layer_patterns(pattern):
  """The replica's rule against vLLM's on synthetic patterns (s sliding, f full), including uneven splits."""
  # pylint: disable=import-outside-toplevel  # see above
  from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

  from maxtext.kv_cache.kv_cache_groups import plan_groups

  common = {"block_size": 16, "num_kv_heads": 2, "head_size": 128, "dtype": torch.float32}
  full, sliding = FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=128)
  specs = {f"layer.{i}": sliding if c == "s" else full for i, c in enumerate(pattern)}
  kinds = dict.fromkeys(specs, "attention")
  ours = [list(g.layer_names) for g in plan_groups(list(specs), specs, kinds, True)]
  assert ours == _vllm_groups(specs)
