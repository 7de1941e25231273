"""Tests for the token-to-request mapping shared by the ragged kernels."""

import jax
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


@pytest.mark.slow
def test_align_state_indices_read_the_last_computed_block_and_write_the_last_new_one():
  # Block size 4, 4 columns per request: a decode crossing into block 2, a chunk inside block 1, a fresh prefill,
  # a chunk resuming from a hit at 8, one padded row.
  tables = np.array([[11, 12, 13, 0], [21, 22, 0, 0], [31, 0, 0, 0], [0, 42, 43, 0], [9, 9, 9, 9]], np.int32)
  seq_lens = np.array([9, 7, 3, 12, 5], np.int32)
  qsl = np.array([0, 1, 3, 6, 10, 10], np.int32)  # new tokens 1, 2, 3, 4
  read, write = ragged_batch.align_state_indices(
      jnp.asarray(tables.reshape(-1)), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray([1, 1, 4], np.int32), 4, 50
  )
  # computed = 8, 5, 0, 8: read columns 1, 1, 0, 1; write columns 2, 1, 0, 2.
  np.testing.assert_array_equal(np.asarray(read), [12, 22, 31, 42, 0])
  np.testing.assert_array_equal(np.asarray(write), [13, 22, 31, 43, 0])
  # Slots beyond the pool are clipped to it, as tpu-inference does.
  _, clipped = ragged_batch.align_state_indices(
      jnp.asarray(tables.reshape(-1)), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray([1, 1, 4], np.int32), 4, 20
  )
  np.testing.assert_array_equal(np.asarray(clipped), [13, 19, 19, 19, 0])


def test_align_state_indices_rejects_bad_arguments():
  args = (jnp.zeros((10,), jnp.int32), jnp.zeros((4,), jnp.int32), jnp.zeros((5,), jnp.int32), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="block_tables must be flat"):
    ragged_batch.align_state_indices(*args, 4, 8)
  with pytest.raises(ValueError, match="mamba_block_size must be >= 1"):
    ragged_batch.align_state_indices(jnp.zeros((8,), jnp.int32), *args[1:], 0, 8)


def test_has_initial_state_needs_a_restored_read_slot():
  layout = ragged_batch.token_layout(4, jnp.asarray([0, 1, 3, 4], np.int32), jnp.asarray([1, 1, 3], np.int32))
  seq_lens = jnp.asarray([5, 2, 3], np.int32)  # computed 4, 0, 2
  np.testing.assert_array_equal(np.asarray(ragged_batch.has_initial_state(layout, seq_lens)), [True, False, True])
  read = jnp.asarray([7, 3, 0], np.int32)
  np.testing.assert_array_equal(np.asarray(ragged_batch.has_initial_state(layout, seq_lens, read)), [True, False, False])


def test_materialize_returns_its_values_and_stays_a_separate_computation():
  """The values pass through unchanged, and the compiled program keeps the conditional that stops XLA from fusing
  (and recomputing) them into their consumers; a negative anchor (malformed metadata) yields zeros."""
  values = (jnp.array([3, 1, 2], jnp.int32), jnp.array([True, False, True]))

  def use(values, anchor):
    ids, keep = ragged_batch.materialize(values, anchor)
    return jnp.where(keep[:, None, None], jnp.ones((3, 64, 64))[ids % 3], 0.0), ids, keep

  fn = jax.jit(use)
  _, ids, keep = fn(values, jnp.array([2, 2, 5], jnp.int32))
  np.testing.assert_array_equal(ids, [3, 1, 2])
  np.testing.assert_array_equal(keep, [True, False, True])
  _, ids, keep = fn(values, jnp.array([-1, 0, 0], jnp.int32))
  np.testing.assert_array_equal(ids, [0, 0, 0])
  assert not keep.any()
  assert "conditional" in fn.lower(values, jnp.array([2, 2, 5], jnp.int32)).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize("rows", [[2], [4], [1, 4, 0]])
def test_set_rows_writes_in_range_rows_in_place(rows):
  """Like `.at[].set(mode="drop")`, and a single row stays a scatter (no copy of the target via a
  dynamic-update-slice)."""
  target = jnp.arange(12.0).reshape(4, 3)
  index = jnp.array(rows, jnp.int32)
  updates = -jnp.ones((len(rows), 3))
  np.testing.assert_array_equal(ragged_batch.set_rows(target, index, updates), target.at[index].set(updates, mode="drop"))
  hlo = jax.jit(ragged_batch.set_rows, donate_argnums=0).lower(target, index, updates).compile().as_text()
  assert "scatter" in hlo and "dynamic-update-slice" not in hlo
