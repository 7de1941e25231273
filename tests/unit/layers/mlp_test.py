"""Gated MLP with silu / gelu-tanh and optional biases against float64 NumPy; gpt-oss's clamped SwiGLU."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.reference import mlp as ref_mlp
from support.reference import module_params
from maxtext.layers.mlp import MLP, clamped_swiglu, get_activation


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_mlp_matches_reference(activation, use_bias):
  layer = MLP(12, 20, activation=activation, use_bias=use_bias, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  if use_bias:
    for sub in (layer.gate, layer.up, layer.down):
      sub.bias[...] = jnp.asarray(rng.normal(size=sub.bias[...].shape), jnp.float32)
  x = rng.normal(size=(2, 5, 12)).astype(np.float32)
  p = module_params(layer)
  assert set(p) == {"gate.kernel", "up.kernel", "down.kernel"} | (
      {"gate.bias", "up.bias", "down.bias"} if use_bias else set()
  )
  x64 = x.astype(np.float64)
  g = x64 @ p["gate.kernel"] + (p["gate.bias"] if use_bias else 0)
  u = x64 @ p["up.kernel"] + (p["up.bias"] if use_bias else 0)
  act = g / (1 + np.exp(-g)) if activation == "silu" else _gelu_tanh(g)
  ref = (act * u) @ p["down.kernel"] + (p["down.bias"] if use_bias else 0)
  out = np.asarray(layer(jnp.asarray(x)))
  np.testing.assert_allclose(out, ref, atol=2e-5)
  np.testing.assert_allclose(ref_mlp(x[0], p, "", activation), ref[0], atol=1e-12)


def test_unknown_activation():
  with pytest.raises(ValueError, match=r"mlp activation must be one of \['gelu_tanh', 'silu'\], got 'relu'"):
    get_activation("relu")
  with pytest.raises(ValueError, match="got 'gelu'"):
    MLP(4, 8, activation="gelu", rngs=nnx.Rngs(0))


def test_clamped_swiglu_clamps_gate_from_above_and_up_on_both_sides():
  gate = jnp.asarray([-9.0, -1.0, 0.5, 3.0, 9.0])
  up = jnp.asarray([-9.0, -0.5, 0.0, 2.0, 9.0])
  got = np.asarray(clamped_swiglu(gate, up, alpha=1.702, limit=2.5))
  g = np.minimum(np.asarray(gate, np.float64), 2.5)  # -9 stays -9: no lower clamp on the gate
  want = (np.clip(np.asarray(up, np.float64), -2.5, 2.5) + 1) * g / (1 + np.exp(-1.702 * g))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
