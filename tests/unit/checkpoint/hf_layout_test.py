"""Tests of the Hugging Face -> canonical re-layout recipes, against explicit index formulas."""

import numpy as np
import pytest

from maxtext.checkpoint import hf_layout
from maxtext.configs import available_models, load_config
from maxtext.models import flat_param_shapes


def _by_target(recipes):
  return {name: (recipe, k) for recipe in recipes for k, (name, _) in enumerate(recipe.targets)}


def _run(recipe, sources):
  return recipe.convert(lambda j: sources[j], np.float64)


@pytest.mark.parametrize(
    "model_name, overrides",
    # Each real-size config takes seconds: those run in the slow set, the tiny ones (the same recipes) in the quick one.
    [
        (name, {}) if name.endswith("-tiny") else pytest.param(name, {}, marks=pytest.mark.slow)
        for name in available_models()
    ]
    + [
        ("qwen3-next-tiny", {"shared_expert_mlp_dim": 0}),
        ("llama-tiny", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3-tiny", {"attention_bias": True, "logits_via_embedding": True}),
    ],
)
def test_recipe_targets_are_exactly_the_model_parameters(model_name, overrides):
  cfg = load_config(model_name=model_name, **overrides)
  targets = {name: shape for r in hf_layout.build_recipes(cfg) for name, shape in r.targets}
  expected = {name: tuple(s.shape) for name, s in flat_param_shapes(cfg).items()}
  assert targets == expected


def test_gated_q_proj_is_split_per_head():
  hq, dh, d = 3, 2, 5
  w = np.random.default_rng(0).normal(size=(hq * 2 * dh, d))
  q, gate = _run(hf_layout._gated_q("w", hq, dh, d, "q", "g"), [w])  # pylint: disable=protected-access  # unit under test
  for h in range(hq):
    for j in range(dh):
      np.testing.assert_array_equal(q[:, h, j], w[h * 2 * dh + j])  # row of head h's q half
      np.testing.assert_array_equal(gate[:, h, j], w[h * 2 * dh + dh + j])


def test_grouped_qkvz_and_ba_become_flat():
  nk, nv, hk, hv, d = 2, 4, 3, 2, 5
  r = nv // nk
  rng = np.random.default_rng(1)
  qkvz = rng.normal(size=(2 * nk * hk + 2 * nv * hv, d))
  ba = rng.normal(size=(2 * nv, d))
  qkv, z = _run(hf_layout._grouped_qkvz("w", nk, nv, hk, hv, d, "qkv", "z"), [qkvz])  # pylint: disable=protected-access
  b, a = _run(hf_layout._grouped_ba("w", nk, nv, d, "b", "a"), [ba])  # pylint: disable=protected-access
  group = 2 * hk + 2 * r * hv  # rows per key head g: [q_g | k_g | v_g (r*hv) | z_g (r*hv)]
  for g in range(nk):
    base = g * group
    for i in range(hk):
      np.testing.assert_array_equal(qkv[:, g * hk + i], qkvz[base + i])
      np.testing.assert_array_equal(qkv[:, nk * hk + g * hk + i], qkvz[base + hk + i])
    for j in range(r):
      head = g * r + j  # value head index
      for i in range(hv):
        np.testing.assert_array_equal(qkv[:, 2 * nk * hk + head * hv + i], qkvz[base + 2 * hk + j * hv + i])
        np.testing.assert_array_equal(z[:, head * hv + i], qkvz[base + 2 * hk + r * hv + j * hv + i])
      np.testing.assert_array_equal(b[:, head], ba[g * 2 * r + j])
      np.testing.assert_array_equal(a[:, head], ba[g * 2 * r + r + j])


def test_conv_o_proj_and_stacked_experts():
  rng = np.random.default_rng(2)
  conv_w = rng.normal(size=(6, 1, 4))
  (conv,) = _run(hf_layout._conv("w", 6, 4, "c"), [conv_w])  # pylint: disable=protected-access
  for c in range(6):
    for k in range(4):
      assert conv[k, c] == conv_w[c, 0, k]
  o_w = rng.normal(size=(5, 3 * 2))
  (o,) = _run(hf_layout._o_proj("w", 3, 2, 5, "o"), [o_w])  # pylint: disable=protected-access
  for h in range(3):
    for j in range(2):
      np.testing.assert_array_equal(o[h, j], o_w[:, h * 2 + j])
  experts = [rng.normal(size=(4, 5)) for _ in range(3)]
  recipe = hf_layout._stacked(["e0", "e1", "e2"], 4, 5, "gate")  # pylint: disable=protected-access
  (stacked,) = recipe.convert(lambda j: experts[j], np.float32)
  assert stacked.shape == (3, 5, 4) and stacked.dtype == np.float32
  for e in range(3):
    np.testing.assert_array_equal(stacked[e], experts[e].T.astype(np.float32))
