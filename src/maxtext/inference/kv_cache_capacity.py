"""What a KV cache of some bytes holds: blocks a request keeps per group, and concurrent requests, hybrid on and off.

A request of `L` tokens, once prefilled and decoding, keeps `cdiv(L, block_size)` blocks in a group that keeps
every block, and in a sliding-window group only the blocks a later query can still read (`prefix_cache.
first_window_block`); a prefill chunk briefly holds up to `max_num_batched_tokens` more in a sliding group. The one
pool admits `(num_blocks - 1) // (blocks a request keeps over every group)` such requests, and a model with
recurrent layers no more than it has state slots. The comparison keeps the bytes: `hybrid_kv_cache=false` gets as
many blocks as the same bytes hold in its own layout (an array per layer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from maxtext.configs import config_to_dict
from maxtext.kv_cache.kv_cache_groups import ATTENTION, cdiv
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.prefix_cache import first_window_block


@dataclasses.dataclass(frozen=True)
class Capacity:
  """What one layout holds for requests of `context` tokens.

  Attributes:
    hybrid_kv_cache: the layout's setting.
    cache_bytes: bytes of every cache array (attention blocks and recurrent state slots).
    num_blocks: blocks of the pool (block 0 is reserved).
    block_bytes: bytes of one block id over every attention array.
    blocks_per_group: group description -> blocks one request keeps in it.
    tokens_per_group: group description -> tokens of keys and values those blocks keep.
    concurrent_requests: requests of `context` tokens the pool (and the state slots) admit at once.
  """

  hybrid_kv_cache: bool
  context: int
  cache_bytes: int
  num_blocks: int
  block_bytes: int
  blocks_per_group: dict[str, int]
  tokens_per_group: dict[str, int]
  concurrent_requests: int

  @property
  def blocks_per_request(self) -> int:
    """Blocks one request keeps over every group."""
    return sum(self.blocks_per_group.values())


def cache_bytes(manager: KVCacheManager) -> int:
  """Bytes of every physical cache array of `manager`."""
  return sum(entry.nbytes for entry in manager.describe_slots())


def request_blocks(manager: KVCacheManager, context: int) -> dict[str, int]:
  """Group description -> blocks a decoding request of `context` tokens keeps in each attention group.

  Raises:
    ValueError: `context` is below 1.
  """
  if context < 1:
    raise ValueError(f"context must be >= 1 token, got {context}")
  blocks = {}
  for group in manager.groups:
    if group.kind != ATTENTION:
      continue
    total = cdiv(context, group.block_size)
    blocks[group.describe()] = total - min(total, first_window_block(context - 1, group.block_size, group.sliding_window))
  return blocks


def capacity(manager: KVCacheManager, context: int) -> Capacity:
  """What `manager`'s pool holds for requests of `context` tokens (see the module docstring)."""
  blocks = request_blocks(manager, context)
  per_request = sum(blocks.values())
  concurrent = (manager.num_blocks - 1) // per_request if per_request else manager.num_blocks - 1
  if manager.has_recurrent and not manager.uses_state_blocks:
    concurrent = min(concurrent, manager.num_state_slots - 1)
  return Capacity(
      bool(manager.cfg.hybrid_kv_cache),
      context,
      cache_bytes(manager),
      manager.num_blocks,
      manager.block_bytes,
      blocks,
      {g.describe(): blocks[g.describe()] * g.block_size for g in manager.groups if g.kind == ATTENTION},
      concurrent,
  )


def compare(cfg: Any, specs: Any, shared: Any) -> tuple[Capacity, Capacity]:
  """Capacities for requests of `max_target_length` tokens with the config's `hybrid_kv_cache` and its opposite,
  the latter sized to the same bytes as the former (its `kv_cache_memory_bytes` set to them).

  Args:
    cfg: a loaded config.
    specs, shared: the per-layer specs and KV-shared layers (`kv_cache_spec.get_kv_cache_specs` and
      `get_shared_kv_cache_layers`).

  Returns:
    (hybrid on, hybrid off).
  """
  context = int(cfg.max_target_length)
  this = KVCacheManager(cfg, specs, shared)
  values = config_to_dict(cfg)
  values.update(hybrid_kv_cache=not bool(cfg.hybrid_kv_cache), kv_cache_memory_bytes=cache_bytes(this), num_kv_blocks=0)
  other = KVCacheManager(ml_collections.FrozenConfigDict(values), specs, shared)
  first, second = capacity(this, context), capacity(other, context)
  return (first, second) if first.hybrid_kv_cache else (second, first)


def format_capacity(on: Capacity, off: Capacity) -> str:
  """Lines per group and in total, hybrid allocator on and off, for the CLI's dry run."""
  lines = [f"capacity for requests of max_target_length={on.context} tokens in {on.cache_bytes} bytes of KV cache:"]
  for cap in (on, off):
    lines.append(
        f"  hybrid_kv_cache={str(cap.hybrid_kv_cache).lower()}: {cap.num_blocks} blocks of {cap.block_bytes} bytes"
        f" ({cap.num_blocks - 1} usable)"
    )
    for name, blocks in cap.blocks_per_group.items():
      lines.append(f"    {name}: {blocks} blocks a request ({cap.tokens_per_group[name]} tokens kept)")
    lines.append(
        f"    total: {cap.blocks_per_request} blocks a request; {cap.concurrent_requests} concurrent requests"
        f" ({cap.concurrent_requests * cap.context} tokens of context)"
    )
  if off.concurrent_requests:
    lines.append(f"  hybrid on admits {on.concurrent_requests / off.concurrent_requests:.2f}x the requests of off")
  return "\n".join(lines)
