"""The paged (runner) path equals the dense full-sequence forward for every tiny family and batch shape.

A small harness plays the runner: caches in the runner's layouts (paged attention per KV-cache group with its own
shuffled block ids, recurrent state slots with slot 0 null), ragged flat batches with decodes first, padded token
and request tails with stale positions, chunked prefills and token-by-token decodes. Every real token's logits
must match the dense forward's logits at that position.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.configs import available_models, load_config
from maxtext.inference.batch import next_power_of_two
from maxtext.kv_cache import kv_cache_spec
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.kernels.backend import default_backend
from maxtext.models import Transformer, assign_params, get_flat_params

ATOL = 1e-4
# Gated DeltaNet hybrids with this package's default random init (variance 1/fan_in) are ill-conditioned: some
# heads' outputs nearly cancel and the gated RMSNorm rescales them, so fp32 rounding (~1e-7 per layer) grows to a
# few 1e-4 in logits (the dense model's own chunked and recurrent forms differ by up to 3.5e-4). With weights at
# the scale transformers initialises them (std 0.05, as the parity tests use), both forms agree to ~1e-5, so the
# hybrids are checked at that scale, at the same tolerance as every other family.
HYBRIDS = ("qwen3_next", "qwen3_5")
HF_INIT_STD = 0.05
# Every tiny config in configs/models: a new family is covered as soon as its tiny config exists.
FAMILIES = [name for name in available_models() if name.endswith("-tiny")]
MAX_REQS = 8
NUM_BLOCKS = 48
BLOCK_SIZE = 4
MAX_LEN = 64


@dataclasses.dataclass
class Req:
  """A request: its tokens, how many are in the cache, its state slot."""

  rid: int
  tokens: np.ndarray
  computed: int = 0
  slot: int = 0


class PagedHarness:
  """A minimal runner: per-group block allocators with shuffled ids, state slots, ragged metadata."""

  def __init__(self, cfg, model, seed=0, free_out_of_window=False):
    self.cfg, self.model = cfg, model
    self.rng = np.random.default_rng(seed)
    self.free_out_of_window = free_out_of_window
    specs = [kv_cache_spec.get_layer_spec(cfg, i) for i in range(cfg.base_num_decoder_layers)]
    self.group_of_layer = []
    self.groups = []  # attention specs in order of first occurrence
    caches = []
    for i, spec in enumerate(specs):
      if isinstance(spec, kv_cache_spec.AttentionSpec):
        if spec not in self.groups:
          self.groups.append(spec)
        self.group_of_layer.append(self.groups.index(spec))
        if cfg.kv_shared_source[i] >= 0:
          caches.append(None)  # never read: a KV-shared layer's slot is its source's (`layer_indices`)
        else:
          caches.append(jnp.zeros(spec.cache_shape(NUM_BLOCKS), spec.dtype))
      else:
        self.group_of_layer.append(None)
        conv, rec = spec.cache_shapes(MAX_REQS + 1)
        # Garbage in every slot: a request without earlier tokens must read zeros, not the slot's contents.
        caches.append(
            (
                jnp.asarray(self.rng.normal(size=conv), spec.state_dtypes[0]),
                jnp.asarray(self.rng.normal(size=rec), "float32"),
            )
        )
    self.caches = caches
    # One slot per layer in layer order, except that KV-shared layers use their source's slot.
    self.layer_indices = tuple(src if src >= 0 else i for i, src in enumerate(cfg.kv_shared_source))
    # Each group hands out its own shuffled block ids (never block 0, the null block).
    self.free = [list(self.rng.permutation(np.arange(1, NUM_BLOCKS))) for _ in self.groups]
    self.tables = {}  # (rid, group) -> list of block ids
    self.next_slot = 1

  def add(self, req):
    """Admits a request: it gets the next recurrent state slot."""
    req.slot = self.next_slot
    self.next_slot += 1

  def _ensure_blocks(self, req, n_new):
    for g, spec in enumerate(self.groups):
      table = self.tables.setdefault((req.rid, g), [])
      if self.free_out_of_window and spec.sliding_window:
        # The step's earliest query is at `computed`; it needs keys >= computed - W + 1. Free first, so this
        # very step can reuse the blocks.
        first_needed = max(0, req.computed - spec.sliding_window + 1)
        for b in range(first_needed // BLOCK_SIZE):
          if table[b]:
            self.free[g].append(table[b])  # LIFO: the next allocation reuses it at once
            table[b] = 0
      while len(table) * BLOCK_SIZE < req.computed + n_new:
        table.append(int(self.free[g].pop()))

  def run_step(self, plan, pad_tokens=3):
    """plan: list of (req, n_new); returns {rid: logits [n_new, V]}."""
    plan = [p for p in plan if p[1] == 1] + [p for p in plan if p[1] != 1]  # decodes first
    n_dec = sum(1 for _, n in plan if n == 1)
    tokens, positions, qsl, seq_lens, slots = [], [], [0], [], []
    for req, n in plan:
      tokens += list(req.tokens[req.computed : req.computed + n])
      positions += list(range(req.computed, req.computed + n))
      qsl.append(qsl[-1] + n)
      seq_lens.append(req.computed + n)
      slots.append(req.slot)
      self._ensure_blocks(req, n)
    t = len(tokens)
    # At least `pad_tokens` of padding, up to a power-of-two bucket as the runner pads (few shapes, few compiles).
    pad_tokens = max(16, next_power_of_two(t + pad_tokens)) - t
    tokens += [0] * pad_tokens
    positions += list(self.rng.integers(0, MAX_LEN, pad_tokens))  # stale, as the runner leaves them
    s = len(plan)
    qsl += [qsl[-1]] * (MAX_REQS - s)
    seq_lens += [0] * (MAX_REQS - s)
    slots += [0] * (MAX_REQS - s)
    max_blocks = MAX_LEN // BLOCK_SIZE
    mds_by_group = []
    for g in range(max(1, len(self.groups))):
      tables = np.zeros((MAX_REQS, max_blocks), np.int32)
      for i, (req, _) in enumerate(plan):
        row = self.tables.get((req.rid, g), [])
        tables[i, : len(row)] = row
      mds_by_group.append(
          AttentionMetadata(
              input_positions=jnp.asarray(positions, jnp.int32),
              block_tables=jnp.asarray(tables.reshape(-1)),
              seq_lens=jnp.asarray(seq_lens, jnp.int32),
              query_start_loc=jnp.asarray(qsl, jnp.int32),
              request_distribution=jnp.asarray([n_dec, n_dec, s], jnp.int32),
              mamba_state_indices=jnp.asarray(slots, jnp.int32),
              padded_num_reqs=MAX_REQS,
          )
      )
    mds = [mds_by_group[g if g is not None else 0] for g in self.group_of_layer]
    graphdef, state = nnx.split(self.model)
    logits, self.caches = _paged_step(
        graphdef,
        self.layer_indices,
        state,
        self.caches,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        mds,
    )
    logits = np.asarray(logits)
    assert np.all(np.isfinite(logits[:t]))
    out = {}
    for i, (req, n) in enumerate(plan):
      out[req.rid] = logits[qsl[i] : qsl[i] + n]
      req.computed += n
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _paged_step(graphdef, layer_indices, state, caches, tokens, positions, mds):
  """One runner step; jitted once per model and shape bucket, shared by every harness."""
  model = nnx.merge(graphdef, state)
  hidden, caches = model.forward_paged(model.embed(tokens), positions, caches, layer_indices, mds)
  return model.compute_logits(hidden), caches


_MODELS = {}
_DENSE = {}


def _model(name):
  if name not in _MODELS:
    cfg = load_config(model_name=name, block_size=BLOCK_SIZE)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if cfg.decoder_block in HYBRIDS:
      # Matrices rescaled to transformers' init scale (see HF_INIT_STD); vectors (norms, A_log, dt_bias) kept.
      params = {k: np.asarray(v) for k, v in get_flat_params(model).items()}
      assign_params(model, {k: v * (HF_INIT_STD / v.std()) if v.ndim >= 2 else v for k, v in params.items()})
    _MODELS[name] = (cfg, model)
  return _MODELS[name]


def _dense_logits(model, tokens):
  """The full-sequence forward's logits at every token, through one jitted forward per model padded to MAX_LEN
  (the forward is causal: the padding after the last token cannot change its logits)."""
  if id(model) not in _DENSE:
    _DENSE[id(model)] = jax.jit(lambda ids: model(ids[None])[0])
  padded = np.zeros(MAX_LEN, np.int32)
  padded[: len(tokens)] = tokens
  return np.asarray(_DENSE[id(model)](jnp.asarray(padded)))[: len(tokens)]


def _requests(cfg, lengths, seed=1):
  rng = np.random.default_rng(seed)
  return [Req(i, rng.integers(3, cfg.vocab_size, n)) for i, n in enumerate(lengths)]


def _check(harness, model, reqs, schedule):
  got = {r.rid: [] for r in reqs}
  for plan in schedule:
    for rid, logits in harness.run_step(plan).items():
      got[rid].append(logits)
  worst = 0.0
  for r in reqs:
    paged = np.concatenate(got[r.rid])
    dense = _dense_logits(model, r.tokens)
    assert paged.shape == dense.shape
    np.testing.assert_allclose(paged, dense, atol=ATOL, rtol=0, err_msg=f"request {r.rid}")
    worst = max(worst, float(np.max(np.abs(paged - dense))))
  print(f"\n{harness.cfg.model_name}: max |paged - dense| logit error = {worst:.2e}")


def _chunked_schedule(reqs, chunk):
  """Each request prefills `chunk` tokens per step until 3 tokens remain, then decodes one per step; all requests
  share every step (a ragged mix of prefills and decodes)."""
  remaining = {r.rid: len(r.tokens) for r in reqs}
  steps = []
  while any(remaining.values()):
    plan = []
    for r in reqs:
      left = remaining[r.rid]
      if left == 0:
        continue
      n = 1 if left <= 3 else min(chunk, left - 3)
      plan.append((r, n))
      remaining[r.rid] -= n
    steps.append(plan)
  return steps


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_one_prefill_then_decodes(name):
  cfg, model = _model(name)
  reqs = _requests(cfg, [5, 13, 21])
  h = PagedHarness(cfg, model)
  for r in reqs:
    h.add(r)
  prefill = [(r, len(r.tokens) - 2) for r in reqs]
  _check(h, model, reqs, [prefill, [(r, 1) for r in reqs], [(r, 1) for r in reqs]])


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_then_token_by_token(name, chunk):
  cfg, model = _model(name)
  reqs = _requests(cfg, [6, 11, 19], seed=chunk)
  h = PagedHarness(cfg, model, seed=chunk)
  for r in reqs:
    h.add(r)
  _check(h, model, reqs, _chunked_schedule(reqs, chunk))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-tiny", "kvshare-tiny", "gpt-oss-tiny"])
def test_sliding_window_blocks_freed_and_reused_still_match(name):
  cfg, model = _model(name)
  assert cfg.sliding_window_size < 20
  reqs = _requests(cfg, [26, 23, 9], seed=7)
  h = PagedHarness(cfg, model, seed=3, free_out_of_window=True)
  for r in reqs:
    h.add(r)
  # Request 2 joins late: its blocks come from the ones requests 0/1 freed out of their windows.
  schedule = [[(reqs[0], 12), (reqs[1], 10)], [(reqs[0], 10), (reqs[1], 9)], [(reqs[2], 7)]]
  schedule += [[(r, 1) for r in reqs] for _ in range(2)] + [[(reqs[0], 1), (reqs[1], 1)] for _ in range(2)]
  _check(h, model, reqs, schedule)
  sliding = [g for g, spec in enumerate(h.groups) if spec.sliding_window]
  assert any(0 in h.tables[(0, g)] for g in sliding), "no block was freed out of the window"
  reused = set(h.tables[(2, sliding[0])]) & (set(range(1, NUM_BLOCKS)) - set(h.tables[(0, sliding[0])]))
  assert reused


def test_groups_get_different_block_tables():
  cfg, model = _model("gemma3-tiny")
  reqs = _requests(cfg, [14, 9], seed=5)
  h = PagedHarness(cfg, model, seed=11)
  for r in reqs:
    h.add(r)
  _check(h, model, reqs, [[(reqs[0], 14), (reqs[1], 8)], [(reqs[1], 1)]])
  assert len(h.groups) == 2 and h.tables[(0, 0)] != h.tables[(0, 1)]


@pytest.mark.slow
def test_kv_shared_layer_reads_the_cache_its_source_just_wrote():
  cfg, model = _model("kvshare-tiny")
  shared = [i for i, s in enumerate(cfg.kv_shared_source) if s >= 0]
  assert shared
  reqs = _requests(cfg, [10], seed=2)
  h = PagedHarness(cfg, model)
  h.add(reqs[0])
  before = list(h.caches)
  _check(h, model, reqs, [[(reqs[0], 10)]])
  layer = shared[0]
  source = cfg.kv_shared_source[layer]
  # The shared layer reads its source's slot, which the source wrote in this step; its own entry is never used.
  assert h.layer_indices[layer] == source and h.caches[layer] is None
  assert not np.array_equal(h.caches[source], before[source])
  # Reading the stale (pre-step) cache would lose the current tokens: the output differs.
  md = AttentionMetadata(
      input_positions=jnp.arange(10, dtype=jnp.int32),
      block_tables=jnp.asarray(
          np.pad(h.tables[(0, h.group_of_layer[layer])], (0, MAX_LEN // BLOCK_SIZE * MAX_REQS - 3)), jnp.int32
      ),
      seq_lens=jnp.asarray([10] + [0] * 7, jnp.int32),
      query_start_loc=jnp.asarray([0] + [10] * 8, jnp.int32),
      request_distribution=jnp.asarray([0, 0, 1], jnp.int32),
      padded_num_reqs=MAX_REQS,
  )
  x = jnp.asarray(np.random.default_rng(0).normal(size=(10, cfg.base_emb_dim)), jnp.float32)
  attn = model.layers[layer].attn
  fresh, _ = attn.paged(x, jnp.arange(10), h.caches[source], md, default_backend())
  stale, _ = attn.paged(x, jnp.arange(10), before[source], md, default_backend())
  assert float(jnp.max(jnp.abs(fresh - stale))) > 1e-3


def test_forward_paged_rejects_wrong_lengths():
  cfg, model = _model("llama-tiny")
  x = jnp.zeros((4, cfg.base_emb_dim))
  with pytest.raises(ValueError, match=r"one slot and one metadata per layer \(4 layers\); got 1 slots and 2 metadata"):
    model.forward_paged(x, jnp.zeros((4,), jnp.int32), [None] * 4, (0,), [None, None])
  with pytest.raises(ValueError, match=r"expects x \[T, D\] and positions \[T\]"):
    model.forward_paged(x, jnp.zeros((5,), jnp.int32), [None] * 4, (0, 1, 2, 3), [None] * 4)


def test_gdn_layer_needs_state_indices():
  cfg, model = _model("qwen3.5-tiny")
  layer = model.layers[0]
  spec = kv_cache_spec.get_layer_spec(cfg, 0)
  conv, rec = spec.cache_shapes(2)
  md = AttentionMetadata(
      input_positions=jnp.arange(2, dtype=jnp.int32),
      block_tables=None,
      seq_lens=jnp.asarray([2], jnp.int32),
      query_start_loc=jnp.asarray([0, 2], jnp.int32),
      request_distribution=jnp.asarray([0, 0, 1], jnp.int32),
      padded_num_reqs=1,
  )
  state = (jnp.zeros(conv), jnp.zeros(rec))
  with pytest.raises(ValueError, match="needs attention_metadata.mamba_state_indices"):
    layer.paged(jnp.zeros((2, cfg.base_emb_dim)), jnp.arange(2), state, md)
