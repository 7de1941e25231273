"""The Hugging Face -> canonical re-layouts every family shares, against explicit index formulas."""

import numpy as np

from maxtext.layers import tensor_sources


def _run(source, tensors, dtype=np.float64):
  return source.convert(lambda j: tensors[j], dtype)


def test_gated_q_proj_is_split_per_head():
  hq, dh, d = 3, 2, 5
  w = np.random.default_rng(0).normal(size=(hq * 2 * dh, d))
  source = tensor_sources.gated_q("w", hq, dh, d)
  assert source.outputs == ((d, hq, dh), (d, hq, dh))
  q, gate = _run(source, [w])
  for h in range(hq):
    for j in range(dh):
      np.testing.assert_array_equal(q[:, h, j], w[h * 2 * dh + j])  # row of head h's q half
      np.testing.assert_array_equal(gate[:, h, j], w[h * 2 * dh + dh + j])


def test_conv_o_proj_and_stacked_experts():
  rng = np.random.default_rng(2)
  conv_w = rng.normal(size=(6, 1, 4))
  (conv,) = _run(tensor_sources.depthwise_conv("w", 6, 4), [conv_w])
  for c in range(6):
    for k in range(4):
      assert conv[k, c] == conv_w[c, 0, k]
  o_w = rng.normal(size=(5, 3 * 2))
  (o,) = _run(tensor_sources.o_proj("w", 3, 2, 5), [o_w])
  for h in range(3):
    for j in range(2):
      np.testing.assert_array_equal(o[h, j], o_w[:, h * 2 + j])
  experts = [rng.normal(size=(4, 5)) for _ in range(3)]
  source = tensor_sources.stacked(["e0", "e1", "e2"], 4, 5)
  assert source.shapes == ((4, 5),) * 3 and source.outputs == ((3, 5, 4),)
  (stacked,) = _run(source, experts, np.float32)
  assert stacked.shape == (3, 5, 4) and stacked.dtype == np.float32
  for e in range(3):
    np.testing.assert_array_equal(stacked[e], experts[e].T.astype(np.float32))


def test_split_rows_of_a_weight_and_of_its_bias():
  rng = np.random.default_rng(3)
  w, b = rng.normal(size=(2 + 3 + 1, 4)), rng.normal(size=(6,))
  z, xbc, dt = _run(tensor_sources.split_rows("w", (2, 3, 1), 4), [w])
  np.testing.assert_array_equal(np.concatenate([z, xbc, dt], axis=1), w.T)
  parts = _run(tensor_sources.split_rows("b", (2, 3, 1), None), [b])
  assert [p.shape for p in parts] == [(2,), (3,), (1,)]
  np.testing.assert_array_equal(np.concatenate(parts), b)


def test_fused_experts_and_linear_transpose():
  rng = np.random.default_rng(4)
  e, fe, d = 2, 3, 4
  gate_up, down = rng.normal(size=(e, 2 * fe, d)), rng.normal(size=(e, d, fe))
  gate, up = _run(tensor_sources.fused_gate_up("gu", e, fe, d), [gate_up])
  np.testing.assert_array_equal(gate, gate_up[:, :fe].transpose(0, 2, 1))
  np.testing.assert_array_equal(up, gate_up[:, fe:].transpose(0, 2, 1))
  (stored_down,) = _run(tensor_sources.fused_down("d", e, fe, d), [down])
  np.testing.assert_array_equal(stored_down, down.transpose(0, 2, 1))
  (kernel,) = _run(tensor_sources.linear("l", 3, 5), [rng.normal(size=(3, 5))])
  assert kernel.shape == (5, 3) and kernel.flags.c_contiguous


def test_a_source_moves_under_a_prefix():
  source = tensor_sources.same("norm.weight", (4,))
  moved = source.under("model.layers.2.")
  assert moved.tensors == ("model.layers.2.norm.weight",) and moved.convert is source.convert
  assert source.tensors == ("norm.weight",)
