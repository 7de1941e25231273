"""Block hashes of token prefixes, and the prefix hit rule of the KV-cache manager (`enable_prefix_caching`).

A full block of `block_size` tokens is named by a chained hash: block j's hash is SHA-256 of block j-1's hash and
block j's token ids, so equal hashes mean equal whole prefixes, not only equal blocks. The hash is stable across
processes (hashlib, not Python's salted `hash`). Full blocks are registered under their hash once their K/V are
written, and stay findable after their requests free them until evicted (LRU, `block_pool.py`).

Recurrent layers use the "align" scheme: the recurrent group holds a table of state blocks, one per
`mamba_block_size` tokens; a step reads its initial state from the block of its last computed token and writes
its final state into the block of its last new token, so the block of column j holds the state after
`(j + 1) * mamba_block_size` tokens once a step ends there (prefill chunks stop at every state boundary for
that). A new request resumes from the longest prefix EVERY group hits: full-attention groups need every block of
it, sliding-window groups only the blocks inside the window of the resume point, the recurrent group the state
block at the resume point. So the resume point is on a state boundary, and a request never claims a state that
was not restored.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

ROOT_HASH = b"maxtext-prefix-cache-v1"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
  """The chained hash of one block: SHA-256 over the parent block's hash and the block's token ids (int64).

  Args:
    parent_hash: the previous block's hash (`ROOT_HASH` for the first block).
    token_ids: the block's tokens.
  """
  digest = hashlib.sha256(parent_hash)
  digest.update(np.asarray(token_ids, np.int64).tobytes())
  return digest.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> list[bytes]:
  """Appends the hashes of the full blocks of `token_ids` not yet in `hashes` (in place); returns `hashes`.

  Raises:
    ValueError: `block_size` < 1.
  """
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1 to hash blocks, got {block_size}")
  for j in range(len(hashes), len(token_ids) // block_size):
    parent = hashes[j - 1] if j else ROOT_HASH
    hashes.append(hash_block_tokens(parent, token_ids[j * block_size : (j + 1) * block_size]))
  return hashes


def first_window_block(num_computed_tokens: int, block_size: int, sliding_window: int | None) -> int:
  """The first block a group still needs when a step starts at `num_computed_tokens`: a query at q >= c reads keys
  above `q - W`, so blocks below `(c - W + 1) // block_size` are out of every later window (0 without a window)."""
  if not sliding_window:
    return 0
  return max(0, num_computed_tokens - sliding_window + 1) // block_size


Lookup = Callable[[bytes], "int | None"]


def attention_hit(lookup: Lookup, hashes: Sequence[bytes], limit: int, block_size: int, window: int | None) -> int:
  """The largest k <= `limit` such that an attention group can resume after k blocks.

  Without a window every block of the prefix must be cached (the longest run of cached leading blocks); with
  one, only the blocks inside the window of the resume point `k * block_size`.
  """
  if not window:
    k = 0
    while k < limit and lookup(hashes[k]) is not None:
      k += 1
    return k
  for k in range(limit, 0, -1):
    if all(lookup(hashes[j]) is not None for j in range(first_window_block(k * block_size, block_size, window), k)):
      return k
  return 0


def state_hit(lookup: Lookup, hashes: Sequence[bytes], limit: int, blocks_per_state: int) -> int:
  """The largest k <= `limit`, a multiple of `blocks_per_state`, whose state checkpoint (the state after k hashed
  blocks, registered under hash k - 1) is cached; 0 when there is none."""
  for k in range(limit // blocks_per_state * blocks_per_state, 0, -blocks_per_state):
    if lookup(hashes[k - 1]) is not None:
      return k
  return 0


def common_hit(group_hits: Sequence[Callable[[int], int]], limit: int) -> int:
  """The largest length at which every group hits: `limit` lowered by each group's hit in turn until none lowers
  it (each `group_hits[g](n)` returns that group's largest hit <= n)."""
  while True:
    lowered = limit
    for hit in group_hits:
      lowered = hit(lowered)
    if lowered == limit:
      return limit
    limit = lowered


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  """Cached blocks a new request starts from.

  Attributes:
    num_tokens: tokens the request skips (a multiple of the hash block size, and of `mamba_block_size` when the
      model has recurrent layers); 0 for a miss.
    blocks: attention group id -> the block table of the cached prefix (`num_tokens / block_size` entries; 0
      where a sliding-window group needs no block).
    state_block: the recurrent group's state block holding the state after `num_tokens` tokens (None without
      recurrent layers or for a miss).
  """

  num_tokens: int
  blocks: Mapping[int, tuple[int, ...]]
  state_block: int | None
