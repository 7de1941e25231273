"""Tests for the token-to-request mapping shared by the ragged kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels import ragged_batch


def test_token_layout_of_a_padded_batch():
  """Request ids, offsets and validity of a batch with padded tokens and requests."""
  # Requests of 1, 3 and 2 tokens, two padded request rows, three padded tokens.
  qsl = jnp.array([0, 1, 4, 6, 6, 6], jnp.int32)
  layout = ragged_batch.token_layout(9, qsl, jnp.array([1, 1, 3], jnp.int32))
  valid = np.asarray(layout.token_valid)
  np.testing.assert_array_equal(valid, [1, 1, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(layout.request_ids)[valid], [0, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(np.asarray(layout.token_offsets)[valid], [0, 0, 1, 2, 0, 1])
  np.testing.assert_array_equal(layout.query_lens, [1, 3, 2, 0, 0])
  np.testing.assert_array_equal(layout.request_valid, [1, 1, 1, 0, 0])
  assert int(layout.num_valid_requests) == 3
  assert np.all((np.asarray(layout.request_ids) >= 0) & (np.asarray(layout.request_ids) < 5))


def test_token_layout_ignores_requests_beyond_the_distribution():
  """Rows past distribution[2] are padding even with tokens."""
  qsl = jnp.array([0, 2, 5, 7], jnp.int32)
  layout = ragged_batch.token_layout(8, qsl, jnp.array([0, 0, 2], jnp.int32))
  np.testing.assert_array_equal(layout.token_valid, [1, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(layout.query_lens, [2, 3, 0])


def test_token_layout_of_the_precompile_dummy_has_no_valid_token():
  """query_start_loc all ones and no request: no token."""
  layout = ragged_batch.token_layout(4, jnp.ones(5, jnp.int32), jnp.zeros(3, jnp.int32))
  np.testing.assert_array_equal(layout.token_valid, False)
  np.testing.assert_array_equal(layout.request_valid, False)


def test_has_initial_state():
  """Only real requests with earlier tokens read their stored state."""
  qsl = jnp.array([0, 1, 4, 6, 6], jnp.int32)
  layout = ragged_batch.token_layout(8, qsl, jnp.array([1, 1, 3], jnp.int32))
  seq_lens = jnp.array([5, 3, 4, 9], jnp.int32)  # decode with history, new prefill, chunked prefill, padded row
  np.testing.assert_array_equal(ragged_batch.has_initial_state(layout, seq_lens), [True, False, True, False])


@pytest.mark.parametrize(
    "num_requests, qsl_shape, dist_shape, match",
    [
        (0, (1,), (3,), r"where: the batch needs at least one request row \(S >= 1\); got S = 0"),
        (4, (4,), (3,), r"where: query_start_loc must have shape \(S \+ 1,\) = \(5,\) for S = 4 requests; got \(4,\)"),
        (4, (5,), (6,), r"where: distribution must have shape \(3,\); got \(6,\)"),
    ],
)
def test_check_ragged_metadata(num_requests, qsl_shape, dist_shape, match):
  """Shape errors name the caller and the expected shape."""
  with pytest.raises(ValueError, match=match):
    ragged_batch.check_ragged_metadata(num_requests, jnp.zeros(qsl_shape), jnp.zeros(dist_shape), "where")
