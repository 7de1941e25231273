"""MoE routing (softmax in fp32, top-k, renormalisation), every experts method, shared expert gate."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.reference import module_params
from maxtext.layers.mlp import get_activation
from maxtext.kernels.experts import experts_dense, experts_gather
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.layers import moe
from maxtext.layers.moe import MoE, route


def _silu(x):
  return x / (1 + np.exp(-x))


def _ref_moe(x, p, top_k, normalize, shared):
  """Token-by-token float64 MoE written from the definition."""
  x = x.astype(np.float64)
  out = np.zeros_like(x)
  logits = x @ p["router.kernel"]
  for t in range(x.shape[0]):
    probs = np.exp(logits[t] - logits[t].max())
    probs /= probs.sum()
    order = np.argsort(-probs)[:top_k]
    w = probs[order]
    if normalize:
      w = w / w.sum()
    for e, we in zip(order, w):
      h = _silu(x[t] @ p["gate"][e]) * (x[t] @ p["up"][e])
      out[t] += we * (h @ p["down"][e])
    if shared:
      s = _silu(x[t] @ p["shared.gate.kernel"]) * (x[t] @ p["shared.up.kernel"])
      gate = 1 / (1 + np.exp(-(x[t] @ p["shared_gate.kernel"])))
      out[t] += gate * (s @ p["shared.down.kernel"])
  return out


@pytest.mark.parametrize("normalize", [True, False])
def test_route_top_k_and_renormalisation(normalize):
  logits = np.array([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 4.0]], np.float32)
  w, idx = route(jnp.asarray(logits), top_k=2, normalize=normalize)
  np.testing.assert_array_equal(np.asarray(idx), [[1, 2], [2, 3]])
  probs = np.exp(logits.astype(np.float64))
  probs /= probs.sum(-1, keepdims=True)
  ref = np.take_along_axis(probs, np.array([[1, 2], [2, 3]]), axis=-1)
  if normalize:
    ref = ref / ref.sum(-1, keepdims=True)
  assert w.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-6)


def test_route_softmax_runs_in_float32_for_bfloat16_logits():
  w, _ = route(jnp.array([[0.0, 0.01]], jnp.bfloat16), top_k=1, normalize=False)
  assert w.dtype == jnp.float32


def test_route_rejects_bad_top_k():
  with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
    route(jnp.zeros((1, 4)), top_k=5, normalize=True)


@pytest.mark.parametrize("method", ["tiled", "ragged", "dense", "gather"])
@pytest.mark.parametrize("normalize,shared", [(True, True), (False, False), (False, True)])
def test_moe_matches_reference(method, normalize, shared):
  layer = MoE(16, 6, 2, 12, shared_mlp_dim=10 if shared else 0, normalize_top_k=normalize, method=method,
              rngs=nnx.Rngs(0))  # fmt: skip
  p = {k: v.astype(np.float64) for k, v in module_params(layer).items()}
  expected = {"router.kernel", "gate", "up", "down"}
  if shared:
    expected |= {"shared.gate.kernel", "shared.up.kernel", "shared.down.kernel", "shared_gate.kernel"}
  assert set(p) == expected
  assert p["gate"].shape == (6, 16, 12) and p["down"].shape == (6, 12, 16)
  x = np.random.default_rng(1).normal(size=(3, 5, 16)).astype(np.float32)
  out = np.asarray(layer(jnp.asarray(x)))
  assert out.shape == (3, 5, 16)
  ref = np.reshape(_ref_moe(x.reshape(15, 16), p, 2, normalize, shared), (3, 5, 16))
  np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.slow
def test_shared_expert_output_is_scaled_by_sigmoid_gate_per_token():
  layer = MoE(8, 4, 1, 6, shared_mlp_dim=5, rngs=nnx.Rngs(2))
  x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 8)), jnp.float32)
  shared = np.asarray(layer.shared(x), np.float64)
  layer.shared_gate.kernel[...] = jnp.zeros((8, 1))  # gate 0.5 for every token
  routed = np.asarray(layer(x), np.float64) - 0.5 * shared
  kernel = np.random.default_rng(5).normal(size=(8, 1)) * 2
  layer.shared_gate.kernel[...] = jnp.asarray(kernel, jnp.float32)
  gate = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ kernel)))
  np.testing.assert_allclose(np.asarray(layer(x)), routed + gate * shared, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA")
@pytest.mark.parametrize("gate_shared", [True, False])
def test_shared_expert_projections_take_one_kernel_call(monkeypatch, gate_shared):
  """At decode sizes the router and the shared expert's gate, up and sigmoid gate are one kernel call, and the routed
  experts' gate and up another; the output equals, bit for bit, the one computed with each product called alone."""
  assert cpu_gemm.load()
  layer = MoE(16, 6, 2, 12, shared_mlp_dim=10, gate_shared=gate_shared, rngs=nnx.Rngs(4))
  x = jnp.asarray(np.random.default_rng(6).normal(size=(3, 16)), jnp.float32)
  backend = CpuBackend()
  program = jax.jit(lambda x: layer(x, backend)).lower(x).as_text()
  calls = collections.Counter(re.findall(r"custom_call @(\w+)", program))
  together = np.asarray(layer(x, backend))
  monkeypatch.setattr(moe, "project", lambda x, layers, backend: tuple(layer(x, backend) for layer in layers))
  monkeypatch.setattr(
      cpu_gemm, "expert_matmuls", lambda x, ws, experts: tuple(cpu_gemm.expert_matmul(x, w, experts) for w in ws)
  )
  alone = np.asarray(layer(x, backend))
  # The shared expert's down; the router and the shared expert's projections in one call; the routed experts' gate
  # and up in one call, their down in another.
  assert calls == {
      "maxtext_small_gemm_nn": 1,
      "maxtext_small_gemm_nn_many": 1,
      "maxtext_expert_gemm_many": 1,
      "maxtext_expert_gemm": 1,
  }
  np.testing.assert_array_equal(together, alone)


@pytest.mark.slow
def test_dense_and_gather_agree_in_bfloat16():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(7, 8)), jnp.bfloat16)
  wg, wu = (jnp.asarray(rng.normal(size=(5, 8, 6)) * 0.3, jnp.bfloat16) for _ in range(2))
  wd = jnp.asarray(rng.normal(size=(5, 6, 8)) * 0.3, jnp.bfloat16)
  w, idx = route(jnp.asarray(rng.normal(size=(7, 5)), jnp.float32), top_k=3, normalize=True)
  kw = {"activation": get_activation("silu"), "dtype": jnp.float32}
  a = experts_dense(x, w, idx, wg, wu, wd, **kw)
  b = experts_gather(x, w, idx, wg, wu, wd, **kw)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((8, 0, 1, 4), {}, "MoE needs num_experts > 0 and moe_mlp_dim > 0, got 0 and 4"),
        ((8, 4, 1, 0), {}, "MoE needs num_experts > 0 and moe_mlp_dim > 0, got 4 and 0"),
        ((8, 4, 5, 4), {}, r"num_experts_per_tok must be in \[1, 4\], got 5"),
        ((8, 4, 2, 4), {"method": "sparse"}, "MoE method must be one of .*got 'sparse'"),
        ((8, 4, 2, 4), {"activation": "tanh"}, "mlp activation must be one of"),
    ],
)
def test_moe_validation(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    MoE(*args, rngs=nnx.Rngs(0), **kwargs)


def test_gpt_oss_experts_are_deinterleaved():
  w = np.arange(2 * 3 * 8, dtype=np.float64).reshape(2, 3, 8)  # [E, D, 2*Fe], gate at even columns
  source = moe.interleaved_gate_up("experts.gate_up_proj", (2, 3, 8))
  assert source.outputs == ((2, 3, 4), (2, 3, 4))
  gate, up = source.convert(lambda j: w, np.float32)
  np.testing.assert_array_equal(gate, w[..., 0::2])
  np.testing.assert_array_equal(up, w[..., 1::2])
  assert gate.flags.c_contiguous and gate.dtype == np.float32
