"""The step's flat model inputs and attention metadata, as NumPy arrays (what the runner's `_prepare_inputs` makes).

Layout (upstream contract; R = max_num_reqs = max(max_num_seqs, 8), P_g = cdiv(max_target_length, block_size_g)):
  input_ids        [padded_T] int32   tokens of every request back to back, decodes first; padding 0
  positions        [padded_T] int32   num_computed + offset; padding 0
  seq_lens         [R] int32          num_computed + num_scheduled (the KV length after the step); padding 0
  query_start_loc  [R + 1] int32      cumulative token counts; the tail repeats the total
  request_distribution [3] int32      [n_decode, n_decode, n_reqs] (decode = exactly one scheduled token)
  mamba_state_indices [R] int32       the request's recurrent state slot; padding 0 (None without recurrent layers,
                                      and under prefix caching)
  block_tables     per group [R * P_g] int32, row-major per request; padding 0 (the recurrent group's are all 0:
                   GDN ignores block tables; under prefix caching they hold the request's state blocks, one per
                   mamba_block_size tokens, P = cdiv(max_target_length, mamba_block_size))
  logits_indices   [padded_num_reqs] int32  query_start_loc[i+1] - 1 for real requests; padding 0 (a valid row
                   whose logits are discarded)
padded_T is the smallest power of two >= T and >= the config's `min_token_bucket` (1 by default; tpu-inference's
smallest is 16), at most max_num_batched_tokens rounded up to a power of two; padded_num_reqs the smallest power
of two >= the request count, at least 8, capped at R. Logits are computed only for the requests that sample, their
rows padded to a power of two (`engine_programs.sampling_logits_indices`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from maxtext.inference.kv_cache_manager import ATTENTION, MIN_REQUEST_BUCKET, KVCacheManager, max_num_reqs
from maxtext.inference.scheduler import SchedulerOutput
from maxtext.kernels.attention_metadata import AttentionMetadata

MIN_TOKEN_BUCKET = 16  # the runner's smallest bucket; the config's min_token_bucket overrides it (default 1)
# The field names of AttentionMetadata, in its order (metadata_fields() dicts construct it in one line).
METADATA_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionMetadata))


def next_power_of_two(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_num_tokens(num_tokens: int, max_num_batched_tokens: int, min_bucket: int = MIN_TOKEN_BUCKET) -> int:
  """The token bucket of a step: the smallest power of two >= num_tokens and >= `min_bucket` (a power of two).

  Raises:
    ValueError: num_tokens exceeds max_num_batched_tokens.
  """
  if num_tokens > max_num_batched_tokens:
    raise ValueError(f"{num_tokens} scheduled tokens exceed max_num_batched_tokens={max_num_batched_tokens}")
  return max(min_bucket, next_power_of_two(num_tokens))


def padded_num_requests(num_reqs: int, num_req_rows: int) -> int:
  """The request bucket of a step: a power of two >= num_reqs, at least 8, capped at `num_req_rows`.

  Raises:
    ValueError: num_reqs exceeds num_req_rows.
  """
  if num_reqs > num_req_rows:
    raise ValueError(f"{num_reqs} scheduled requests exceed max_num_reqs={num_req_rows}")
  return min(max(MIN_REQUEST_BUCKET, next_power_of_two(num_reqs)), num_req_rows)


@dataclasses.dataclass(frozen=True)
class BatchInputs:
  """Flat inputs of one step (module docstring for the layout); request i of the batch is row i of the logits.

  Attributes:
    request_ids: requests in batch order (decodes first).
    num_scheduled_tokens: tokens per request, batch order.
    num_decodes: requests with exactly one token (they lead the batch).
    input_ids: [padded_T] int32.
    positions: [padded_T] int32.
    seq_lens: [R] int32.
    query_start_loc: [R + 1] int32.
    request_distribution: [3] int32.
    mamba_state_indices: [R] int32, or None when the model has no recurrent layers.
    block_tables: one [R * P_g] int32 array per KV-cache group (`KVCacheManager.groups` order).
    logits_indices: [padded_num_reqs] int32.
    padded_num_reqs: the request bucket (static for jit).
    layer_names_per_group: the layers of each group (KV-shared layers included).
  """

  request_ids: tuple[str, ...]
  num_scheduled_tokens: tuple[int, ...]
  num_decodes: int
  input_ids: np.ndarray
  positions: np.ndarray
  seq_lens: np.ndarray
  query_start_loc: np.ndarray
  request_distribution: np.ndarray
  mamba_state_indices: np.ndarray | None
  block_tables: tuple[np.ndarray, ...]
  logits_indices: np.ndarray
  padded_num_reqs: int
  layer_names_per_group: tuple[tuple[str, ...], ...]

  @property
  def num_reqs(self) -> int:
    """Real requests in the step."""
    return len(self.request_ids)

  @property
  def num_tokens(self) -> int:
    """Real tokens in the step (T)."""
    return sum(self.num_scheduled_tokens)

  @property
  def padded_num_tokens(self) -> int:
    """The token bucket (padded_T)."""
    return int(self.input_ids.shape[0])

  def metadata_fields(self) -> list[dict[str, Any]]:
    """One dict per KV-cache group with exactly the `AttentionMetadata` field names (`METADATA_FIELDS`).

    Groups differ only in `block_tables`; the other arrays are the same objects in every dict.
    """
    return [
        {
            "input_positions": self.positions,
            "block_tables": table,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
            "request_distribution": self.request_distribution,
            "mamba_state_indices": self.mamba_state_indices,
            "padded_num_reqs": self.padded_num_reqs,
        }
        for table in self.block_tables
    ]


def _planned_computed_tokens(request: Any, num_new: int, scheduler_output: SchedulerOutput, one_step_ahead: bool) -> int:
  """The computed-token count the plan was made at for `request`, checked against the request (see `build_batch`'s
  `one_step_ahead`)."""
  rid = request.request_id
  computed = scheduler_output.num_computed_tokens[rid]
  if one_step_ahead:
    if num_new != 1 or request.num_computed_tokens + 1 != computed:
      raise ValueError(
          f"request {rid!r}: a plan one step ahead computes 1 token at 1 past the request's computed count; got"
          f" {num_new} tokens at {computed} with num_computed_tokens {request.num_computed_tokens}"
      )
  elif request.num_computed_tokens != computed:
    raise ValueError(
        f"request {rid!r}: num_computed_tokens is {request.num_computed_tokens} but the plan was made at {computed};"
        " build the batch before update_from_output"
    )
  return computed


def _block_tables(
    kv_cache_manager: KVCacheManager, rows: int, computed_at: list[tuple[str, int]]
) -> tuple[list[np.ndarray], np.ndarray | None]:
  """Every group's block table, one row per (request id, computed tokens) of `computed_at` (the recurrent group's
  names state blocks under prefix caching: the align scheme), and the state slots when recurrent states are compact
  (None otherwise)."""
  tables = [np.zeros((rows, kv_cache_manager.max_blocks_per_req(g.group_id)), np.int32) for g in kv_cache_manager.groups]
  compact_slots = kv_cache_manager.has_recurrent and not kv_cache_manager.uses_state_blocks
  state_indices = np.zeros((rows,), np.int32) if compact_slots else None
  for row, (request_id, computed) in enumerate(computed_at):
    for group in kv_cache_manager.groups:
      if group.kind == ATTENTION:
        table = kv_cache_manager.block_table(request_id, group.group_id)
        tables[group.group_id][row, : len(table)] = table
      elif kv_cache_manager.uses_state_blocks:
        table = kv_cache_manager.state_block_table(request_id)
        # The step reads the block of its last computed token: a restored state must be there.
        mbs = kv_cache_manager.mamba_block_size
        assert computed == 0 or table[(computed - 1) // mbs], (request_id, computed, table)
        tables[group.group_id][row, : len(table)] = table
    if state_indices is not None:
      state_indices[row] = kv_cache_manager.get_state_slot(request_id)
  return tables, state_indices


def _token_rows(
    entries: list[Any], scheduler_output: SchedulerOutput, one_step_ahead: bool, padded_t: int, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[str, int]]]:
  """The token arrays of a batch of `entries` (request, tokens), in order: input ids and positions `[padded_t]`,
  sequence lengths `[rows]`, query start offsets `[rows + 1]`, and each row's (request id, computed tokens)."""
  num_reqs = len(entries)
  input_ids = np.zeros((padded_t,), np.int32)
  positions = np.zeros((padded_t,), np.int32)
  seq_lens = np.zeros((rows,), np.int32)
  query_start_loc = np.zeros((rows + 1,), np.int32)
  computed_at: list[tuple[str, int]] = []  # (request id, computed tokens) per row
  start = 0
  for i, (request, n) in enumerate(entries):
    rid = request.request_id
    computed = _planned_computed_tokens(request, n, scheduler_output, one_step_ahead)
    if not one_step_ahead:
      input_ids[start : start + n] = request.all_token_ids[computed : computed + n]
    positions[start : start + n] = np.arange(computed, computed + n)
    seq_lens[i] = computed + n
    start += n
    query_start_loc[i + 1] = start
    computed_at.append((rid, computed))
  query_start_loc[num_reqs + 1 :] = start
  return input_ids, positions, seq_lens, query_start_loc, computed_at


def build_batch(
    cfg: Any, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager, *, one_step_ahead: bool = False
) -> BatchInputs:
  """Builds the step's inputs from the scheduler's plan and the manager's block tables and state slots.

  Call it after `Scheduler.schedule()` and before `Scheduler.update_from_output()`.

  Args:
    cfg: the loaded config (max_num_seqs, max_num_batched_tokens).
    scheduler_output: the plan of the step.
    kv_cache_manager: the manager holding the requests' blocks and slots.
    one_step_ahead: the plan is a decode step planned while the step before it still runs (the engine's
      overlapped decode steps): every request computes one token, one more than the request's computed count,
      and that token is the one the running step samples, so it is not known yet. Its `input_ids` entry is 0; the
      step program takes the token from the previous step's output on the device.

  Raises:
    ValueError: too many requests or tokens for the buckets, the plan is stale (a request's computed count
      changed since `schedule()`, or is not one below the plan's one step ahead), or a plan one step ahead
      computes more than one token for a request.
  """
  rows = max_num_reqs(cfg)
  entries = [e for e in scheduler_output.scheduled if e.num_new_tokens == 1]
  entries += [e for e in scheduler_output.scheduled if e.num_new_tokens != 1]
  num_reqs = len(entries)
  counts = [n for _, n in entries]
  num_tokens = sum(counts)
  padded_t = padded_num_tokens(num_tokens, int(cfg.max_num_batched_tokens), int(cfg.min_token_bucket))
  padded_reqs = padded_num_requests(num_reqs, rows)

  input_ids, positions, seq_lens, query_start_loc, computed_at = _token_rows(
      entries, scheduler_output, one_step_ahead, padded_t, rows
  )
  tables, state_indices = _block_tables(kv_cache_manager, rows, computed_at)

  num_decodes = sum(1 for n in counts if n == 1)
  logits_indices = np.zeros((padded_reqs,), np.int32)
  logits_indices[:num_reqs] = query_start_loc[1 : num_reqs + 1] - 1
  return BatchInputs(
      request_ids=tuple(r.request_id for r, _ in entries),
      num_scheduled_tokens=tuple(counts),
      num_decodes=num_decodes,
      input_ids=input_ids,
      positions=positions,
      seq_lens=seq_lens,
      query_start_loc=query_start_loc,
      request_distribution=np.array([num_decodes, num_decodes, num_reqs], np.int32),
      mamba_state_indices=state_indices,
      block_tables=tuple(t.reshape(-1) for t in tables),
      logits_indices=logits_indices,
      padded_num_reqs=padded_reqs,
      layer_names_per_group=tuple(g.layer_names for g in kv_cache_manager.groups),
  )
