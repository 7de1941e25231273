"""Gated DeltaNet: conv, l2 norm, gates, chunked vs recurrent delta rule vs a float64 per-token recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import reference
from support.reference import module_params
from maxtext.layers.gated_delta_net import (
    GatedDeltaNet,
    causal_conv1d,
    delta_rule_chunked,
    delta_rule_recurrent,
    gdn_gates,
    grouped_ba,
    grouped_qkvz,
    l2_normalize,
)

D, NK, NV, HK, HV, K = 32, 2, 4, 16, 24, 4


def _ref_delta_rule(q, k, v, g, beta, s0):
  """Per-token float64 recurrence: decay, delta update, read (current token included)."""
  bsz, t, h, _ = q.shape
  o = np.zeros((bsz, t, h, v.shape[-1]))
  s = s0.astype(np.float64).copy()
  for b in range(bsz):
    for hh in range(h):
      for i in range(t):
        s[b, hh] *= np.exp(g[b, i, hh])
        delta = beta[b, i, hh] * (v[b, i, hh] - k[b, i, hh] @ s[b, hh])
        s[b, hh] += np.outer(k[b, i, hh], delta)
        o[b, i, hh] = q[b, i, hh] @ s[b, hh]
  return o, s


def _inputs(t, seed=0, bsz=2, h=3, dk=8, dv=5):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(bsz, t, h, dk)), rng.normal(size=(bsz, t, h, dk))
  q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(bsz, t, h, dv))
  g = -rng.uniform(0.0, 2.0, size=(bsz, t, h))
  beta = rng.uniform(size=(bsz, t, h))
  s0 = rng.normal(size=(bsz, h, dk, dv))
  return q, k, v, g, beta, s0


@pytest.mark.slow
@pytest.mark.parametrize("t,chunk", [(1, 8), (8, 8), (19, 8), (70, 64)])
def test_chunked_and_recurrent_match_float64_recurrence(t, chunk):
  q, k, v, g, beta, s0 = _inputs(t)
  ref_o, ref_s = _ref_delta_rule(q, k, v, g, beta, s0)
  args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]
  s0j = jnp.asarray(s0, jnp.float32)
  o_c, s_c = jax.jit(delta_rule_chunked, static_argnames="chunk_size")(*args, chunk_size=chunk, initial_state=s0j)
  o_r, s_r = jax.jit(delta_rule_recurrent)(*args, initial_state=s0j)
  for o, s in ((o_c, s_c), (o_r, s_r)):
    assert o.dtype == jnp.float32 and o.shape == ref_o.shape and s.shape == ref_s.shape
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5)
    np.testing.assert_allclose(np.asarray(s), ref_s, atol=2e-5)
  np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=2e-5)


def test_delta_rule_default_state_is_zero_and_inputs_may_be_bfloat16():
  q, k, v, g, beta, _ = _inputs(11, seed=1)
  ref_o, _ = _ref_delta_rule(q, k, v, g, beta, np.zeros((2, 3, 8, 5)))
  args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(a, jnp.float32) for a in (g, beta)]
  o_c, _ = jax.jit(delta_rule_chunked, static_argnames="chunk_size")(*args, chunk_size=4)
  o_r, _ = jax.jit(delta_rule_recurrent)(*args)
  assert o_c.dtype == jnp.float32 and o_r.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=1e-5)  # same bf16 inputs, fp32 math
  np.testing.assert_allclose(np.asarray(o_c), ref_o, atol=5e-2)


def test_chunked_rejects_bad_chunk_size():
  q, k, v, g, beta, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(3))
  with pytest.raises(ValueError, match="gdn chunk_size must be positive, got 0"):
    delta_rule_chunked(q, k, v, g, beta, chunk_size=0)


@pytest.mark.slow
def test_causal_conv1d_and_state_continuation():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(2, 9, 6)).astype(np.float32)
  w = rng.normal(size=(K, 6)).astype(np.float32)
  ref = np.zeros((2, 9, 6))
  for t in range(9):
    for j in range(K):  # w[K-1] multiplies x_t
      if t - (K - 1) + j >= 0:
        ref[:, t] += w[j] * x[:, t - (K - 1) + j]
  y, state = causal_conv1d(jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(state), x[:, -(K - 1) :])
  y1, s1 = causal_conv1d(jnp.asarray(x[:, :2]), jnp.asarray(w))  # shorter than K-1
  y2, s2 = causal_conv1d(jnp.asarray(x[:, 2:]), jnp.asarray(w), s1)
  np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), ref, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(s2), np.asarray(state))


def test_l2_normalize_eps_inside_rsqrt_and_gates():
  x = np.array([[3.0, 4.0], [1e-4, 0.0]], np.float32)
  out = np.asarray(l2_normalize(jnp.asarray(x)))
  np.testing.assert_allclose(out, x / np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6), rtol=1e-6)
  a, b = np.array([[0.5, -2.0]]), np.array([[1.0, -3.0]])
  a_log, dt_bias = np.array([0.3, 1.2]), np.array([1.0, 0.5])
  g, beta = gdn_gates(*(jnp.asarray(z, jnp.bfloat16) for z in (a, b)), jnp.asarray(a_log), jnp.asarray(dt_bias))
  assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(g), -np.exp(a_log) * np.log1p(np.exp(a + dt_bias)), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(beta), 1 / (1 + np.exp(-b)), rtol=1e-5)


def _silu(x):
  return x / (1 + np.exp(-x))


def _ref_gdn(x, p):
  """Float64 Gated DeltaNet layer over one sequence x [T, D], following the architecture notes step by step."""
  x = x.astype(np.float64)
  t = len(x)
  qkv = x @ p["qkv.kernel"]
  conv = np.stack([sum(p["conv.kernel"][j] * qkv[i - K + 1 + j] for j in range(K) if i - K + 1 + j >= 0)
                   for i in range(t)])  # fmt: skip
  conv = _silu(conv)
  q = conv[:, : NK * HK].reshape(t, NK, HK)
  k = conv[:, NK * HK : 2 * NK * HK].reshape(t, NK, HK)
  v = conv[:, 2 * NK * HK :].reshape(t, NV, HV)
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * HK**-0.5
  k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  r = NV // NK
  q, k = q[:, [j // r for j in range(NV)]], k[:, [j // r for j in range(NV)]]  # value head j reads key head j // r
  a, b = x @ p["a.kernel"], x @ p["b.kernel"]
  g = -np.exp(p["A_log"]) * np.log1p(np.exp(a + p["dt_bias"]))
  beta = 1 / (1 + np.exp(-b))
  o, _ = _ref_delta_rule(q[None], k[None], v[None], g[None], beta[None], np.zeros((1, NV, HK, HV)))
  o = o[0]
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6) * p["norm.scale"]  # plain w
  o = o * _silu((x @ p["z.kernel"]).reshape(t, NV, HV))
  return o.reshape(t, NV * HV) @ p["out.kernel"]


def _jit_call(layer, x, chunked):
  return nnx.jit(lambda m, x: m(x, chunked=chunked)[0])(layer, jnp.asarray(x))


def _make(chunk=8, seed=0, dtype=jnp.float32):
  layer = GatedDeltaNet(emb_dim=D, num_key_heads=NK, num_value_heads=NV, key_head_dim=HK, value_head_dim=HV,
                        conv_kernel_dim=K, chunk_size=chunk, dtype=dtype, rngs=nnx.Rngs(seed))  # fmt: skip
  rng = np.random.default_rng(seed + 7)
  for var in (layer.dt_bias, layer.norm.scale):
    var[...] = var[...] + jnp.asarray(rng.normal(size=var[...].shape) * 0.3, jnp.float32)
  return layer


def test_parameter_names_and_shapes():
  shapes = {k: v.shape for k, v in module_params(_make()).items()}
  c = 2 * NK * HK + NV * HV
  assert shapes == {
      "qkv.kernel": (D, c),
      "z.kernel": (D, NV * HV),
      "b.kernel": (D, NV),
      "a.kernel": (D, NV),
      "conv.kernel": (K, c),
      "A_log": (NV,),
      "dt_bias": (NV,),
      "norm.scale": (HV,),
      "out.kernel": (NV * HV, D),
  }
  a = np.exp(np.asarray(_make(seed=3).A_log[...]))
  assert np.all((a >= 1.0) & (a <= 16.0))


@pytest.mark.parametrize("t", [5, 19])
def test_layer_chunked_and_recurrent_match_float64_reference(t):
  layer = _make(chunk=8)
  p = {k: v.astype(np.float64) for k, v in module_params(layer).items()}
  x = np.random.default_rng(t).normal(size=(2, t, D)).astype(np.float32)
  chunked = np.asarray(_jit_call(layer, x, True))
  recurrent = np.asarray(_jit_call(layer, x, False))
  for b in range(2):
    ref = _ref_gdn(x[b], p)
    np.testing.assert_allclose(chunked[b], ref, atol=5e-5)
    np.testing.assert_allclose(recurrent[b], ref, atol=5e-5)
    shared = reference.gated_delta_net(x[b], p, "", nk=NK, nv=NV, hk=HK, hv=HV, eps=1e-6)
    np.testing.assert_allclose(shared, ref, atol=1e-10)


@pytest.mark.slow
def test_prefill_then_token_by_token_decode_matches_full_sequence():
  layer = _make(chunk=4, seed=1)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 14, D)), jnp.float32)
  full = np.asarray(_jit_call(layer, x, True))
  step = nnx.jit(lambda m, xt, cs, rs: m.forward_with_state(xt, cs, rs, chunked=False))
  y, conv_state, rec_state = nnx.jit(lambda m, xt: m.forward_with_state(xt))(layer, x[:, :9])
  assert conv_state.shape == (1, K - 1, 2 * NK * HK + NV * HV) and rec_state.shape == (1, NV, HK, HV)
  outs = [np.asarray(y)]
  for i in range(9, 14):
    y, conv_state, rec_state = step(layer, x[:, i : i + 1], conv_state, rec_state)
    outs.append(np.asarray(y))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=2e-5)


def test_bfloat16_compute_runs_recurrence_in_float32():
  layer32 = _make(chunk=8)
  layer16 = _make(chunk=8, dtype=jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(6).normal(size=(1, 12, D)), jnp.float32)
  out16 = _jit_call(layer16, x.astype(jnp.bfloat16), True)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(_jit_call(layer32, x, True)), atol=0.1)
  recurrent16 = _jit_call(layer16, x.astype(jnp.bfloat16), False)
  np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(recurrent16, np.float32), atol=0.03)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_value_heads": 3}, r"gdn value heads \(3\) must be a positive multiple of key heads \(2\)"),
        ({"key_head_dim": 0}, r"head dims positive \(got 0, 24\)"),
        ({"conv_kernel_dim": 0}, "gdn conv_kernel_dim and chunk_size must be >= 1, got 0, 64"),
        ({"chunk_size": 0}, "gdn conv_kernel_dim and chunk_size must be >= 1, got 4, 0"),
    ],
)
def test_validation(kwargs, match):
  args = {"emb_dim": D, "num_key_heads": NK, "num_value_heads": NV, "key_head_dim": HK, "value_head_dim": HV,
          "conv_kernel_dim": K}  # fmt: skip
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    GatedDeltaNet(**args, rngs=nnx.Rngs(0))


def test_grouped_qkvz_and_ba_become_flat():
  nk, nv, hk, hv, d = 2, 4, 3, 2, 5
  r = nv // nk
  rng = np.random.default_rng(1)
  qkvz = rng.normal(size=(2 * nk * hk + 2 * nv * hv, d))
  ba = rng.normal(size=(2 * nv, d))
  qkv, z = grouped_qkvz("w", nk, nv, hk, hv, d).convert(lambda j: qkvz, np.float64)
  b, a = grouped_ba("w", nk, nv, d).convert(lambda j: ba, np.float64)
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
