"""Routed experts as a grouped matmul: (token, expert) pairs sorted by expert, one `jax.lax.ragged_dot` per matrix.

`experts_ragged` has the signature and result of `maxtext.kernels.experts.experts_dense`, but computes each token only
with the experts it selected: the `T * k` (token, choice) rows are sorted by expert id, every expert multiplies its
contiguous run of rows (`ragged_dot` with per-expert group sizes), and the rows are put back in token order and
combined with the routing weights. Work and memory are `O(T * k * D * F)` instead of dense's `O(T * E * D * F)`,
and no `[T, k, D, F]` copy of expert weights is made (as the gather form does).
"""

from typing import Callable

import jax
import jax.numpy as jnp

from maxtext.kernels.experts import Glu, add_bias, check_biases, gated


def check_shapes(x, weights, indices, w_gate, w_up, w_down) -> None:
  """Checks the routed experts' operands (`experts_ragged`'s); raises ValueError naming the one that does not fit."""
  if x.ndim != 2 or weights.ndim != 2 or indices.shape != weights.shape or indices.shape[0] != x.shape[0]:
    raise ValueError(
        f"the MoE experts need x [T, D] and weights, indices [T, k]; got x {x.shape}, weights {weights.shape},"
        f" indices {indices.shape}"
    )
  num_experts, emb_dim, mlp_dim = w_gate.shape
  if w_up.shape != w_gate.shape or w_down.shape != (num_experts, mlp_dim, emb_dim) or emb_dim != x.shape[1]:
    raise ValueError(
        f"the MoE experts need w_gate, w_up [E, D, F] and w_down [E, F, D] with D = x.shape[1] = {x.shape[1]}; got"
        f" w_gate {w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape}"
    )


def sort_by_expert(indices: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The (token, choice) rows in expert order.

  Args:
    indices: `[T, k]` int expert ids.
    num_experts: E.

  Returns:
    order `[T * k]` (flat row `t * k + j` of each sorted position; stable, so a token's rows keep their order
    within an expert), the token of each sorted row `[T * k]`, and group sizes `[E]` int32 (rows per expert).
  """
  flat = indices.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, order // indices.shape[1], group_sizes


def experts_ragged(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dtype: jnp.dtype,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    glu: Glu | None = None,
) -> jax.Array:
  """Only the selected experts per token, as grouped matmuls over the rows sorted by expert.

  Args:
    x: `[T, D]` tokens.
    weights: `[T, k]` routing weights.
    indices: `[T, k]` expert ids in `[0, E)`.
    w_gate: `[E, D, F]`.
    w_up: `[E, D, F]`.
    w_down: `[E, F, D]`.
    activation: gate activation.
    dtype: compute dtype.
    b_gate, b_up: `[E, F]` biases of the gate and up projections, or None.
    b_down: `[E, D]` bias of the down projection, or None.
    glu: `(gate, up) -> hidden` replacing `activation(gate) * up`, or None.

  Returns:
    `[T, D]` in `dtype`.

  Raises:
    ValueError: shapes that disagree (the message names the array and both shapes).
  """
  check_shapes(x, weights, indices, w_gate, w_up, w_down)
  check_biases(w_gate, b_gate, b_up, b_down)
  num_experts, emb_dim, _ = w_gate.shape
  num_tokens, top_k = indices.shape
  order, token_of_row, group_sizes = sort_by_expert(indices, num_experts)
  expert_of_row = indices.reshape(-1)[order]  # [T * k] expert of each sorted row
  rows = x.astype(dtype)[token_of_row]  # [T * k, D], expert-major
  gate = add_bias(jax.lax.ragged_dot(rows, w_gate.astype(dtype), group_sizes), b_gate, expert_of_row, dtype)  # [T * k, F]
  up = add_bias(jax.lax.ragged_dot(rows, w_up.astype(dtype), group_sizes), b_up, expert_of_row, dtype)
  y = jax.lax.ragged_dot(gated(gate, up, activation, glu), w_down.astype(dtype), group_sizes)  # [T * k, D]
  y = add_bias(y, b_down, expert_of_row, dtype)
  # Back to (token, choice) order: sorted position p holds flat row order[p].
  y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(num_tokens, top_k, emb_dim)
  return jnp.einsum("tk,tkd->td", weights.astype(dtype), y)


def tile_rows(num_rows: int, num_experts: int) -> tuple[int, int]:
  """Static tiling of `num_rows` expert-sorted rows: (rows per tile m, most tiles any routing can need).

  Each expert's run of rows is cut into tiles of `m = ceil(num_rows / num_experts)` rows, so an expert with g rows
  takes ceil(g / m) tiles; over all experts that is at most `num_rows / m + min(E, num_rows)` and at most
  `num_rows` (a tile holds at least one row).
  """
  m = max(1, -(-num_rows // num_experts))
  return m, min(num_rows, num_rows // m + min(num_experts, num_rows))


def experts_tiled(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dtype: jnp.dtype,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    glu: Glu | None = None,
) -> jax.Array:
  """`experts_ragged`'s grouped matmul as a loop over expert tiles, for backends without a native grouped matmul.

  The rows sorted by expert are cut into tiles of one expert each (`tile_rows`); a loop runs only over the tiles
  this routing fills (a dynamic trip count) and multiplies each tile by its expert's matrices, read in place.
  Work is at most about twice `T * k` rows of one expert MLP, plus one weight read per tile. Same arguments,
  result and errors as `experts_ragged`.
  """
  check_shapes(x, weights, indices, w_gate, w_up, w_down)
  check_biases(w_gate, b_gate, b_up, b_down)
  num_experts, emb_dim, _ = w_gate.shape
  num_tokens, top_k = indices.shape
  num_rows = num_tokens * top_k
  m, max_tiles = tile_rows(num_rows, num_experts)
  order, token_of_row, group_sizes = sort_by_expert(indices, num_experts)
  tiles_per_expert = (group_sizes + m - 1) // m
  tile_end = jnp.cumsum(tiles_per_expert)  # [E] one past each expert's last tile
  row_start = jnp.cumsum(group_sizes) - group_sizes  # [E] first sorted row of each expert
  tile_ids = jnp.arange(max_tiles)
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, tile_ids, side="right"), num_experts - 1)  # [N]
  local = (tile_ids - (tile_end - tiles_per_expert)[tile_expert])[:, None] * m + jnp.arange(m)  # [N, m]
  valid = local < group_sizes[tile_expert][:, None]
  sorted_row = jnp.where(valid, row_start[tile_expert][:, None] + local, 0)  # [N, m] position in the sorted rows
  tokens = x.astype(dtype)[token_of_row[sorted_row]]  # [N, m, D]
  w_gate, w_up, w_down = w_gate.astype(dtype), w_up.astype(dtype), w_down.astype(dtype)

  def body(tile, out):
    e = tile_expert[tile]
    rows = tokens[tile]  # [m, D]
    h = gated(add_bias(rows @ w_gate[e], b_gate, e, dtype), add_bias(rows @ w_up[e], b_up, e, dtype), activation, glu)
    return out.at[tile].set(add_bias(h @ w_down[e], b_down, e, dtype))

  tiles_out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros((max_tiles, m, emb_dim), dtype))  # [N, m, D]
  # Tile slot (tile, i) holds sorted row sorted_row[tile, i], i.e. flat (token, choice) row order[...].
  flat_row = jnp.where(valid, order[sorted_row], num_rows)  # invalid slots land in a dropped extra row
  y = jnp.zeros((num_rows + 1, emb_dim), dtype).at[flat_row.reshape(-1)].set(tiles_out.reshape(-1, emb_dim))
  return jnp.einsum("tk,tkd->td", weights.astype(dtype), y[:num_rows].reshape(num_tokens, top_k, emb_dim))
