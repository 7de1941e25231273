"""Tests of the grouping and array rules; expected values are worked out by hand from vLLM's and tpu-inference's."""

import dataclasses

import numpy as np
import pytest

from maxtext.kv_cache.kv_cache_groups import GroupPlan, order_arrays, plan_arrays, plan_groups


@dataclasses.dataclass(frozen=True)
class _Spec:
  """An attention spec with what the array key reads."""

  window: int | None
  num_kv_heads: int = 2
  head_dim: int = 64
  dtype: str = "float32"

  def page_size_bytes(self) -> int:
    """Bytes of one block: 16 tokens."""
    return 16 * self.num_kv_heads * self.head_dim * 4


FULL, SLIDING = _Spec(None), _Spec(128)


def _layers(pattern: str):
  """'s'/'f'/'r' per layer: sliding, full, recurrent."""
  names = [f"layer.{i}" for i in range(len(pattern))]
  specs = {n: {"s": SLIDING, "f": FULL, "r": "gdn"}[c] for n, c in zip(names, pattern)}
  kinds = {n: "recurrent" if c == "r" else "attention" for n, c in zip(names, pattern)}
  return names, specs, kinds


def _numbers(groups):
  return [tuple(int(n.split(".")[1]) for n in g.layer_names) for g in groups]


def test_gemma3_5_to_1_of_12_layers_is_6_groups_of_2_sharing_2_arrays():
  names, specs, kinds = _layers("sssssf" * 2)
  groups = plan_groups(names, specs, kinds, True)
  # sliding bucket 0-4, 6-10 (10 layers), full 5, 11 (2): size 2, 5 sliding groups of layers[i::5].
  assert _numbers(groups) == [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11)]
  arrays = plan_arrays(groups, specs, True)
  assert arrays == (tuple(f"layer.{i}" for i in range(6)), tuple(f"layer.{i}" for i in range(6, 12)))


def test_gpt_oss_alternating_layers_pair_up():
  names, specs, kinds = _layers("sfsf")
  groups = plan_groups(names, specs, kinds, True)
  assert _numbers(groups) == [(0, 2), (1, 3)]
  assert plan_arrays(groups, specs, True) == (("layer.0", "layer.1"), ("layer.2", "layer.3"))


def test_a_largest_bucket_below_1_5_times_the_smallest_sets_the_group_size():
  # 12 sliding + 13 full (gpt-oss-20b + a drafter in vLLM's comment): size 13, one group per bucket.
  names, specs, kinds = _layers("sf" * 12 + "f")
  groups = plan_groups(names, specs, kinds, True)
  assert [len(g.layer_names) for g in groups] == [12, 13]


def test_uneven_split_takes_every_nth_layer():
  # 5 sliding, 2 full: size 2, the sliding layers (0, 1, 3, 4, 6) split into 3 groups, layers[i::3].
  names, specs, kinds = _layers("ssfssfs")
  groups = plan_groups(names, specs, kinds, True)
  assert _numbers(groups) == [(0, 4), (1, 6), (3,), (2, 5)]
  # The one-layer group keeps an array of its own, as tpu-inference keys a one-layer tensor apart.
  arrays = plan_arrays(groups, specs, True)
  assert arrays == (("layer.0", "layer.1", "layer.2"), ("layer.4", "layer.5", "layer.6"), ("layer.3",))


def test_recurrent_models_keep_an_array_per_layer_group_by_group():
  names, specs, kinds = _layers("rrrf" * 2)
  groups = plan_groups(names, specs, kinds, True)
  assert _numbers(groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]
  assert [g.kind for g in groups] == ["recurrent"] * 3 + ["attention"]
  assert [a for (a,) in plan_arrays(groups, specs, True)] == [f"layer.{i}" for i in (0, 4, 1, 5, 2, 6, 3, 7)]


def test_without_hybrid_kv_cache_attention_is_one_group_and_every_layer_an_array():
  names, specs, kinds = _layers("sssssf" * 2)
  groups = plan_groups(names, specs, kinds, False)
  assert groups == (GroupPlan("attention", tuple(names)),)
  assert plan_arrays(groups, specs, False) == tuple((n,) for n in names)
  names, specs, kinds = _layers("rrrf" * 2)
  assert _numbers(plan_groups(names, specs, kinds, False)) == [(0, 1, 2, 4, 5, 6), (3, 7)]


def test_layers_of_different_page_layouts_never_share_an_array():
  names = ["layer.0", "layer.1", "layer.2", "layer.3"]
  wide = _Spec(None, head_dim=128)
  specs = {"layer.0": SLIDING, "layer.1": wide, "layer.2": SLIDING, "layer.3": wide}
  kinds = dict.fromkeys(names, "attention")
  groups = plan_groups(names, specs, kinds, True)
  assert _numbers(groups) == [(0, 2), (1, 3)]
  assert len(plan_arrays(groups, specs, True)) == 4


def test_one_layer_groups_get_an_array_each():
  names, specs, kinds = _layers("ssf")
  groups = plan_groups(names, specs, kinds, True)
  assert _numbers(groups) == [(0,), (1,), (2,)]
  assert plan_arrays(groups, specs, True) == (("layer.0",), ("layer.1",), ("layer.2",))


def test_orders():
  arrays = (("layer.1", "layer.5"), ("layer.0", "layer.4"), ("layer.2",))
  assert order_arrays(arrays, "hybrid", 0) == arrays
  assert order_arrays(arrays, "layer", 0) == (("layer.0", "layer.4"), ("layer.1", "layer.5"), ("layer.2",))
  permutation = np.random.default_rng(5).permutation(3)
  assert order_arrays(arrays, "shuffled", 5) == tuple(arrays[p] for p in permutation)
  with pytest.raises(ValueError, match="kv_cache_layout='rows': must be one of layer, hybrid, shuffled"):
    order_arrays(arrays, "rows", 0)


def test_plan_groups_validates_its_input():
  with pytest.raises(ValueError, match="at least one layer"):
    plan_groups([], {}, {}, True)
  with pytest.raises(ValueError, match=r"\['layer.1'\] lack one"):
    plan_groups(["layer.0", "layer.1"], {"layer.0": FULL}, {"layer.0": "attention"}, True)
