"""Token embedding (optional sqrt(D) scale in the weight dtype) and the tied head."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.layers.embeddings import Embed, attend, embed_tokens, greedy_token_ids


def test_embed_and_attend_match_numpy():
  emb = Embed(32, 8, rngs=nnx.Rngs(0))
  table = np.asarray(emb.embedding[...], np.float64)
  tokens = np.array([[3, 0, 31], [7, 7, 1]])
  np.testing.assert_allclose(np.asarray(emb(jnp.asarray(tokens))), table[tokens], atol=0)
  x = np.random.default_rng(0).normal(size=(2, 3, 8))
  np.testing.assert_allclose(np.asarray(emb.attend(jnp.asarray(x, jnp.float32))), x @ table.T, atol=1e-5)


def test_scale_is_cast_to_weight_dtype_before_multiplying():
  # bf16: sqrt(3072) = 55.4256 rounds to 55.5, as transformers' Gemma3 does.
  table = jnp.ones((4, 3072), jnp.bfloat16)
  out = embed_tokens(table, jnp.array([1]), scale=math.sqrt(3072), dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.full((1, 3072), 55.5, np.float32))
  out32 = embed_tokens(table.astype(jnp.float32), jnp.array([1]), scale=math.sqrt(3072), dtype=jnp.float32)
  assert float(out32[0, 0]) == pytest.approx(math.sqrt(3072), rel=1e-7)


def test_scaled_module_and_dtypes():
  emb = Embed(16, 9, use_scale=True, dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  assert emb.embedding[...].dtype == jnp.bfloat16
  out = emb(jnp.array([2, 5]))
  assert out.dtype == jnp.bfloat16
  ref = (np.asarray(emb.embedding[...])[[2, 5]] * ml_dtypes.bfloat16(3.0)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out, np.float32), ref)
  assert attend(emb.embedding[...], jnp.ones((9,)), dtype=jnp.float32).shape == (16,)


def test_embed_rejects_bad_sizes():
  with pytest.raises(ValueError, match="Embed needs positive sizes, got num_embeddings=0, features=4"):
    Embed(0, 4, rngs=nnx.Rngs(0))


def test_greedy_token_ids_are_numpy_argmax_with_ties_to_the_first_index():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((9, 32000)).astype(np.float32)
  logits[1, [7, 300, 31999]] = 50.0  # ties: the first index wins, as with argmax
  logits[2] = -np.inf
  logits[2, 31999] = 0.0  # the last index
  logits[3] = 1.0  # every entry ties
  logits[4, :] = np.float32(-3.0e38)
  logits[4, 5] = np.float32(-1.0e38)
  got = np.asarray(greedy_token_ids(logits))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
  assert got[1] == 7 and got[2] == 31999 and got[3] == 0 and got[4] == 5


def test_greedy_token_ids_of_a_nan_row_is_out_of_range():
  """A NaN row never yields a valid token id by accident; the engine rejects it (check_finite_rows) first."""
  logits = np.zeros((2, 16), np.float32)
  logits[1, 3] = np.nan
  np.testing.assert_array_equal(np.asarray(greedy_token_ids(logits)), [0, 16])


def test_greedy_token_ids_over_candidates_take_the_smallest_id_of_the_maximum():
  logits = np.asarray([[1.0, 3.0, 3.0, 2.0], [0.0, 4.0, 5.0, 5.0]], np.float32)
  ids = np.asarray([[40, 9, 7, 2], [3, 1, 8, 6]], np.int32)
  np.testing.assert_array_equal(np.asarray(greedy_token_ids(logits, ids)), [7, 6])
  nan_row = np.asarray([[np.nan, np.nan]], np.float32)
  np.testing.assert_array_equal(np.asarray(greedy_token_ids(nan_row, np.asarray([[4, 5]], np.int32))), [2**31 - 1])
