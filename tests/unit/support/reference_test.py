"""Sanity checks of the float64 NumPy reference itself against closed forms."""

import math

import numpy as np

from support import reference


def test_activations_and_norm_closed_forms():
  x = np.array([-2.0, 0.0, 1.5])
  np.testing.assert_allclose(reference.silu(x), x / (1 + np.exp(-x)))
  np.testing.assert_allclose(reference.gelu_tanh(np.array([0.0, 100.0, -100.0])), [0.0, 100.0, 0.0], atol=1e-12)
  y = reference.rms_norm(np.array([[3.0, 4.0]]), np.array([2.0, 0.5]), 0.0, False)
  np.testing.assert_allclose(y, [[3 / math.sqrt(12.5) * 2, 4 / math.sqrt(12.5) * 0.5]])
  np.testing.assert_allclose(reference.rms_norm(np.array([[3.0, 4.0]]), np.zeros(2), 0.0, True), y / [2.0, 0.5])


def test_rope_rotates_pairs_by_position_times_frequency():
  freqs = reference.inv_freq(4, 100.0)
  np.testing.assert_allclose(freqs, [1.0, 0.1])
  x = np.zeros((2, 1, 6))
  x[:, 0, 0] = 1.0  # pair (0, 2) at frequency 1
  out = reference.rope(x, np.array([0, 3]), freqs)
  np.testing.assert_allclose(out[0, 0], x[0, 0])
  np.testing.assert_allclose(out[1, 0, [0, 2]], [math.cos(3), math.sin(3)])
  assert np.all(out[:, :, 4:] == 0)  # dims beyond 2 * len(freqs) pass through


def test_inv_freq_scalings():
  np.testing.assert_allclose(reference.inv_freq(4, 100.0, "linear", 4.0), [0.25, 0.025])
  llama = reference.inv_freq(8, 500000.0, "llama3", 8.0, 1.0, 4.0, 64)
  base = reference.inv_freq(8, 500000.0)
  assert llama[0] == base[0] and llama[-1] == base[-1] / 8


def test_moe_without_shared_expert_is_the_weighted_expert_sum():
  p = {
      "router.kernel": np.array([[1.0, 0.0], [0.0, 0.0]]),
      "gate": np.ones((2, 2, 1)),
      "up": np.ones((2, 2, 1)),
      "down": np.array([[[1.0, 0.0]], [[0.0, 1.0]]]),
  }
  x = np.array([[1.0, 1.0]])
  out = reference.moe(x, p, "", top_k=1, normalize=False, activation="silu")
  prob = math.e / (math.e + 1)
  np.testing.assert_allclose(out, [[prob * reference.silu(np.array(2.0)) * 2.0, 0.0]])
