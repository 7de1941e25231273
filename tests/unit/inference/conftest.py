"""Fixtures of the reference-runner tests: tiny hybrid configs and fake KV-cache specs.

The fake specs have the fields and methods the KV-cache manager reads of `maxtext.kv_cache.cache_spec`'s specs,
written here independently from the runner's cache shape `(N, bs, align(2*Hkv, pk)/pk, pk, align(head_dim, 128))`.
"""

import dataclasses
import math

import numpy as np
import pytest

from maxtext.configs import load_config
from maxtext.inference.batch import build_batch
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.inference.scheduler import Scheduler

_ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class FakeAttentionSpec:
  """Attention spec with the interface fields."""

  cache_kind = "attention"
  layer_type: str
  block_size: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  sliding_window: int | None

  def cache_shape(self, num_blocks):
    """Runner layout, rank 5."""
    pk = 4 // _ITEMSIZE[self.dtype]
    packed = -(-2 * self.num_kv_heads // pk)
    return (num_blocks, self.block_size, packed, pk, -(-self.head_dim // 128) * 128)

  def page_size_bytes(self):
    """Bytes of one block."""
    return math.prod(self.cache_shape(1)) * _ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class FakeRecurrentSpec:
  """Recurrent (GDN) spec with the interface fields: a (conv, recurrent) state per slot."""

  cache_kind = "recurrent"
  conv_shape: tuple
  recurrent_shape: tuple
  conv_dtype: str
  recurrent_dtype: str = "float32"
  layer_type: str = "linear_attention"

  @property
  def state_dtypes(self):
    """dtype of each state array."""
    return (self.conv_dtype, self.recurrent_dtype)

  def cache_shapes(self, num_slots):
    """(conv shape, recurrent shape) with `num_slots` rows."""
    return (num_slots,) + tuple(self.conv_shape), (num_slots,) + tuple(self.recurrent_shape)

  def slot_size_bytes(self):
    """Bytes of one slot of both arrays."""
    return math.prod(self.conv_shape) * _ITEMSIZE[self.conv_dtype] + math.prod(self.recurrent_shape) * 4


def fake_kv_cache_specs(cfg):
  """("layer.i" -> spec for layers that own a cache, "layer.i" -> "layer.source" for KV-shared layers)."""
  specs, shared = {}, {}
  dtype = cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
  for i, kind in enumerate(cfg.layer_types):
    name = f"layer.{i}"
    if cfg.kv_shared_source[i] >= 0:
      shared[name] = f"layer.{cfg.kv_shared_source[i]}"
    elif kind == "linear_attention":
      conv = (cfg.gdn_conv_kernel_dim - 1, cfg.gdn_conv_dim)
      rec = (cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim)
      specs[name] = FakeRecurrentSpec(conv, rec, cfg.dtype)
    else:
      window = cfg.sliding_window_size if kind == "sliding_attention" else None
      specs[name] = FakeAttentionSpec(kind, cfg.block_size, cfg.base_num_kv_heads, cfg.head_dim, dtype, window)
  return specs, shared


def qwen3_next_config(**overrides):
  """8 layers [lin, lin, lin, full] * 2."""
  values = {"decoder_block": "qwen3_next", "base_num_decoder_layers": 8, "inhomogeneous_layer_cycle_interval": 4}
  values.update(overrides)
  return load_config(**values)


def gemma3_config(**overrides):
  """6 layers [slide, slide, full] * 2, window 8; with num_kv_shared_layers=2 layer 4 reads 3 and layer 5 reads 2."""
  values = {
      "decoder_block": "gemma3",
      "base_num_decoder_layers": 6,
      "inhomogeneous_layer_cycle_interval": 3,
      "sliding_window_size": 8,
  }
  values.update(overrides)
  return load_config(**values)


def llama_config(**overrides):
  """2 full-attention layers."""
  return load_config(**overrides)


@pytest.fixture(name="configs")
def fixture_configs():
  """Factories of the tiny test configs."""
  return {"qwen3_next": qwen3_next_config, "gemma3": gemma3_config, "llama": llama_config}


@pytest.fixture(name="make_specs")
def fixture_make_specs():
  """`make_specs(cfg) -> (specs, shared_layers)` with fake specs."""
  return fake_kv_cache_specs


@pytest.fixture(name="spec_types")
def fixture_spec_types():
  """The fake spec classes (attention, recurrent)."""
  return FakeAttentionSpec, FakeRecurrentSpec


@pytest.fixture(name="np_rng")
def fixture_np_rng():
  """A seeded NumPy generator."""
  return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------------------
# A stand-in model that runs on the batch arrays: it writes each token into a simulated paged cache through the
# block tables, folds it into a simulated recurrent state through mamba_state_indices, and predicts the next
# token from what it reads back. Any wrong block table, position, seq_len, state slot or missing slot zeroing
# changes the tokens (or trips an assertion), so comparing with `reference_generate` checks the whole pipeline.
_MODULUS = (1 << 61) - 1


def mix_state(state, token):
  """One recurrent-state update of the fake model."""
  return (state * 1000003 + token + 1) % _MODULUS


def next_token(tokens, state):
  """The fake model's prediction from the whole sequence (and the recurrent state; 0 without recurrent layers)."""
  return 3 + (sum((i + 1) * t for i, t in enumerate(tokens)) + state) % 251


def reference_generate(prompt, params, max_target_length, has_recurrent, eos_token_id=None):
  """What the fake model generates for one prompt without any runner machinery."""
  tokens, out = list(prompt), []
  while True:
    state = 0
    if has_recurrent:
      for t in tokens:
        state = mix_state(state, t)
    token = next_token(tokens, state)
    out.append(token)
    tokens.append(token)
    if token in params.stop_token_ids or token == eos_token_id:
      return out, "stop"
    if len(out) >= params.max_tokens or len(tokens) >= max_target_length:
      return out, "length"


class PagedFakeModel:
  """Runs a step on the batch arrays (see the comment above)."""

  def __init__(self, manager):
    self.manager = manager
    self.caches = {
        g.group_id: np.full((manager.num_blocks, g.block_size), -1, np.int64)
        for g in manager.groups
        if g.kind == "attention"
    }
    self.states = [0] * manager.num_state_slots

  def _align_step(self, batch, i, length, tokens):
    """Reads the block of the last computed token (zeros when none was restored), writes the block of the last."""
    gid = next(g.group_id for g in self.manager.groups if g.kind == "recurrent")
    table = batch.block_tables[gid].reshape(batch.seq_lens.shape[0], -1)[i]
    size = self.manager.mamba_block_size
    computed = length - len(tokens)
    read, write = table[max(computed - 1, 0) // size], table[(length - 1) // size]
    assert write != 0, f"step of request row {i} writes its state to the null block"
    assert computed == 0 or read != 0, f"request row {i} resumes at {computed} without a restored state"
    state = self.states[read] if computed else 0
    for t in tokens:
      state = mix_state(state, t)
    self.states[write] = state
    return state

  def step(self, batch, slots_to_zero):
    """Returns {request id: predicted token} for every request of the batch."""
    for slot in slots_to_zero:
      self.states[slot] = 0
    rows = batch.seq_lens.shape[0]
    tables = {gid: batch.block_tables[gid].reshape(rows, -1) for gid in self.caches}
    qsl = batch.query_start_loc
    assert batch.request_distribution.tolist() == [batch.num_decodes, batch.num_decodes, batch.num_reqs]
    predictions = {}
    for i, rid in enumerate(batch.request_ids):
      length = int(batch.seq_lens[i])
      tokens = batch.input_ids[qsl[i] : qsl[i + 1]].tolist()
      positions = batch.positions[qsl[i] : qsl[i + 1]].tolist()
      assert positions == list(range(length - len(tokens), length)), (rid, positions, length)
      reads = {}
      for gid, cache in self.caches.items():
        group = self.manager.groups[gid]
        for p, t in zip(positions, tokens):
          block = tables[gid][i, p // group.block_size]
          assert block != 0, f"{rid}: token at position {p} written to the null block in group {gid}"
          cache[block, p % group.block_size] = t
        visible = range(max(0, length - (group.sliding_window or length)), length)
        blocks = [tables[gid][i, p // group.block_size] for p in visible]
        assert 0 not in blocks, f"{rid}: the last query's window reads the null block in group {gid}"
        reads[gid] = [int(cache[b, p % group.block_size]) for b, p in zip(blocks, visible)]
      full_sequence = next(read for gid, read in reads.items() if not self.manager.groups[gid].sliding_window)
      for gid, read in reads.items():
        assert read == full_sequence[len(full_sequence) - len(read) :], f"{rid}: group {gid} read {read}"
      state = 0
      if batch.mamba_state_indices is not None:
        slot = int(batch.mamba_state_indices[i])
        assert slot != 0, f"{rid}: real request uses the null state slot"
        state = self.states[slot]
        for t in tokens:
          state = mix_state(state, t)
        self.states[slot] = state
      elif self.manager.has_recurrent:  # prefix caching: state blocks of the recurrent group's table (align scheme)
        state = self._align_step(batch, i, length, tokens)
      predictions[rid] = next_token(full_sequence, state)
    return predictions


def run_requests(cfg, requests, make_specs, *, eos_token_id=None, num_state_slots=None, max_steps=2000):
  """Drives scheduler + batch builder + fake model until every request finishes; checks per-step invariants.

  Returns:
    (list of SchedulerOutput, ids of the running requests before each step in arrival order, the manager).
  """
  specs, shared = make_specs(cfg)
  manager = KVCacheManager(cfg, specs, shared, num_state_slots=num_state_slots)
  scheduler = Scheduler(cfg, manager, eos_token_id=eos_token_id)
  model = PagedFakeModel(manager)
  for request in requests:
    scheduler.add_request(request)
  outputs, running_before = [], []
  while scheduler.has_unfinished_requests():
    assert len(outputs) < max_steps, "the scheduler does not make progress"
    running_before.append([r.request_id for r in scheduler.running])
    out = scheduler.schedule()
    counts = [n for _, n in out.scheduled]
    assert 0 < sum(counts) <= cfg.max_num_batched_tokens and len(counts) <= cfg.max_num_seqs
    assert counts == sorted(counts, key=lambda n: n != 1), "decodes must come first"
    assert not set(out.preempted_request_ids) & {r.request_id for r, _ in out.scheduled}
    assert len(scheduler.running) <= cfg.max_num_seqs
    batch = build_batch(cfg, out, manager)
    predictions = model.step(batch, out.slots_to_zero)
    scheduler.update_from_output(out, {rid: predictions[rid] for rid in out.sampling_request_ids})
    outputs.append(out)
  return outputs, running_before, manager


@pytest.fixture(name="run")
def fixture_run(make_specs):
  """`run(cfg, requests, **kwargs)`: see `run_requests`."""
  return lambda cfg, requests, **kwargs: run_requests(cfg, requests, make_specs, **kwargs)


@pytest.fixture(name="reference")
def fixture_reference():
  """`reference(prompt, params, max_target_length, has_recurrent, eos_token_id=None) -> (tokens, reason)`."""
  return reference_generate


@pytest.fixture(name="paged_fake_model")
def fixture_paged_fake_model():
  """The `PagedFakeModel` class: `PagedFakeModel(manager).step(batch, slots_to_zero) -> {request id: token}`."""
  return PagedFakeModel
