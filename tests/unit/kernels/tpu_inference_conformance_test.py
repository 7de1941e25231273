"""Conformance with the released tpu-inference 0.32.0: its own pure-JAX references against this package's kernels.

The wheel is fetched once into the cache dir and its reference files are loaded by path (tests/conftest.py,
`support.tpu_inference_wheel` under `tests/`), never through the package `__init__`. Every batch is random and ragged:
decodes first (as the runner orders them), then fresh prefills and chunked continuations, padded tokens and padded
request rows, and caches / state slots full of stale values from earlier requests ("dirty" reuse). Outputs agree
within fp32 tolerances; caches agree exactly (both sides copy the same rows).

Upstream differences the comparisons account for (docs/runner-contract.md):
- the attention references return only the rows of real tokens; this package also returns zero rows for padding;
- the gated delta rule reference returns values for padded tokens too and zeroes the state of every request row
  without an initial state, so the null slot 0 that padded rows point at is reset; slot 0 is not compared.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.kernels import ragged_conv1d as conv_lib
from maxtext.kernels import ragged_gated_delta_rule as gdr_lib
from maxtext.kernels import ragged_paged_attention as rpa_lib

pytestmark = pytest.mark.slow

F32_ATOL = 2e-5
F32_RTOL = 2e-5
BF16_ATOL = 3e-2

# (tokens already cached, new tokens): decodes first, then a fresh prefill, a chunked continuation, a one-token
# fresh request and a longer fresh prefill.
ATTENTION_REQUESTS = ((9, 1), (3, 1), (14, 1), (0, 6), (5, 4), (0, 1), (0, 9))
DECODE_ONLY = ((4, 1), (11, 1), (1, 1))


def _is_metadata(x) -> bool:
  return isinstance(x, (np.ndarray, jax.Array)) and (
      np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.bool_)
  )


def _jitted_over_concrete_metadata(fn, *args, **kwargs):
  """Runs an upstream attention reference as one jitted program.

  The attention references loop over requests in Python, slicing by the metadata's values, so run eagerly each op compiles
  on its own for every request's shapes (over a minute per case on a 2-core CPU). Under `jax.jit` with the integer
  and boolean arrays (the ragged metadata) closed over as concrete NumPy constants, the same Python runs once and
  XLA compiles one program: the reference's own code, traced instead of dispatched op by op.
  """
  metadata = {i: np.asarray(a) for i, a in enumerate(args) if _is_metadata(a)}
  traced = [a for i, a in enumerate(args) if i not in metadata]

  def run(*traced_args):
    it = iter(traced_args)
    return fn(*(metadata[i] if i in metadata else next(it) for i in range(len(args))), **kwargs)

  return jax.jit(run)(*traced)


def _jitted(fn, *args, **kwargs):
  """Runs a kernel jitted, as a model step runs it: arrays traced (metadata included), other options static. The
  upstream GDN references are written for this (no Python control flow over the metadata)."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
  static = {k: v for k, v in kwargs.items() if k not in arrays}
  return jax.jit(functools.partial(fn, **static))(*args, **arrays)


@dataclasses.dataclass
class AttentionBatch:
  """Random ragged attention inputs in the kernels' argument order (JAX arrays)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  kv_cache: jax.Array
  kv_lens: jax.Array
  page_indices: jax.Array
  cu_q_lens: jax.Array
  distribution: jax.Array

  @property
  def num_valid_tokens(self) -> int:
    """Tokens of real requests."""
    return int(np.asarray(self.cu_q_lens)[np.asarray(self.distribution)[2]])

  def args(self) -> tuple:
    """Positional arguments shared by both implementations."""
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _distribution(requests) -> np.ndarray:
  """The runner's `[decodes, decodes, requests]` (the leading decodes: one new token after earlier ones)."""
  num_decode = 0
  while num_decode < len(requests) and requests[num_decode][1] == 1 and requests[num_decode][0] > 0:
    num_decode += 1
  return np.asarray([num_decode, num_decode, len(requests)], np.int32)


def _attention_batch(
    seed, requests, *, hq=4, hkv=2, d=32, block_size=4, pages_per_seq=6, max_reqs=9, pad_tokens=5, dtype=jnp.float32
) -> AttentionBatch:
  rng = np.random.default_rng(seed)
  num_blocks = max_reqs * pages_per_seq + 1
  # Distinct random pages per request; page 0 stays for padded rows. Every page holds stale values.
  pages = rng.permutation(np.arange(1, num_blocks))
  page_indices = np.zeros((max_reqs, pages_per_seq), np.int32)
  kv_lens = np.zeros(max_reqs, np.int32)
  cu_q_lens = np.zeros(max_reqs + 1, np.int32)
  for i, (prior, new) in enumerate(requests):
    assert -(-(prior + new) // block_size) <= pages_per_seq
    page_indices[i] = pages[i * pages_per_seq : (i + 1) * pages_per_seq]
    kv_lens[i] = prior + new
    cu_q_lens[i + 1] = cu_q_lens[i] + new
  cu_q_lens[len(requests) + 1 :] = cu_q_lens[len(requests)]
  num_tokens = int(cu_q_lens[-1]) + pad_tokens
  shape = rpa_lib.kv_cache_layout.get_kv_cache_shape(num_blocks, block_size, hkv, d, dtype)
  return AttentionBatch(
      q=jnp.asarray(rng.normal(size=(num_tokens, hq, d)), dtype),
      k=jnp.asarray(rng.normal(size=(num_tokens, hkv, d)), dtype),
      v=jnp.asarray(rng.normal(size=(num_tokens, hkv, d)), dtype),
      kv_cache=jnp.asarray(rng.normal(size=shape), dtype),
      kv_lens=jnp.asarray(kv_lens),
      page_indices=jnp.asarray(page_indices.reshape(-1)),
      cu_q_lens=jnp.asarray(cu_q_lens),
      distribution=jnp.asarray(_distribution(requests)),
  )


def _check_attention(ours, theirs, batch, atol=F32_ATOL, rtol=F32_RTOL):
  (out, cache), (ref_out, ref_cache) = ours, theirs
  n = batch.num_valid_tokens
  assert ref_out.shape == (n,) + batch.q.shape[1:]
  np.testing.assert_allclose(np.asarray(out[:n], np.float32), np.asarray(ref_out, np.float32), atol=atol, rtol=rtol)
  assert not np.any(np.asarray(out[n:], np.float32)), "padded rows must be zero"
  np.testing.assert_array_equal(np.asarray(cache, np.float32), np.asarray(ref_cache, np.float32))


@pytest.mark.parametrize(
    "seed, window, soft_cap",
    [(0, None, None), (1, 5, None), (2, None, 30.0), (3, 3, 20.0)],
    ids=["full", "window", "cap", "both"],
)
def test_ragged_paged_attention_matches_upstream_reference(tpu_inference_refs, seed, window, soft_cap):
  batch = _attention_batch(seed, ATTENTION_REQUESTS)
  scale = 32**-0.5
  theirs = _jitted_over_concrete_metadata(
      tpu_inference_refs.ragged_paged_attention, *batch.args(), sm_scale=scale, sliding_window=window, soft_cap=soft_cap
  )
  ours = _jitted(rpa_lib.ragged_paged_attention, *batch.args(), sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
  _check_attention(ours, theirs, batch)


@pytest.mark.parametrize("hq, hkv, d", [(8, 1, 128), (6, 3, 200)])
def test_ragged_paged_attention_matches_upstream_across_head_shapes(tpu_inference_refs, hq, hkv, d):
  batch = _attention_batch(3, ATTENTION_REQUESTS[2:], hq=hq, hkv=hkv, d=d, block_size=8, pages_per_seq=3)
  theirs = _jitted_over_concrete_metadata(tpu_inference_refs.ragged_paged_attention, *batch.args(), sm_scale=d**-0.5)
  ours = _jitted(rpa_lib.ragged_paged_attention, *batch.args(), sm_scale=d**-0.5)
  _check_attention(ours, theirs, batch)


def test_ragged_paged_attention_decode_only_batch_matches_upstream(tpu_inference_refs):
  batch = _attention_batch(4, DECODE_ONLY, pad_tokens=3)
  theirs = _jitted_over_concrete_metadata(tpu_inference_refs.ragged_paged_attention, *batch.args(), sm_scale=0.2)
  ours = _jitted(rpa_lib.ragged_paged_attention, *batch.args(), sm_scale=0.2)
  _check_attention(ours, theirs, batch)


def test_ragged_paged_attention_bf16_cache_matches_upstream(tpu_inference_refs):
  # bf16 packs two rows per 32-bit word (pk = 2); the reference computes its softmax in bf16, hence the tolerance.
  batch = _attention_batch(5, ATTENTION_REQUESTS, dtype=jnp.bfloat16)
  theirs = _jitted_over_concrete_metadata(
      tpu_inference_refs.ragged_paged_attention, *batch.args(), sm_scale=32**-0.5, sliding_window=6
  )
  ours = _jitted(rpa_lib.ragged_paged_attention, *batch.args(), sm_scale=32**-0.5, sliding_window=6)
  _check_attention(ours, theirs, batch, atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_kv_sharing_read_matches_the_source_layers_upstream_step(tpu_inference_refs, window):
  # A KV-sharing layer reads (update_kv_cache=False) the cache its source layer wrote this step.
  batch = _attention_batch(6, ATTENTION_REQUESTS)
  ref_out, ref_cache = _jitted_over_concrete_metadata(
      tpu_inference_refs.ragged_paged_attention, *batch.args(), sm_scale=0.3, sliding_window=window
  )
  rest = batch.args()[4:]
  out, cache = rpa_lib.ragged_paged_attention(
      batch.q, None, None, ref_cache, *rest, sm_scale=0.3, sliding_window=window, update_kv_cache=False, num_kv_heads=2
  )
  assert cache is ref_cache
  n = batch.num_valid_tokens
  np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out), atol=F32_ATOL, rtol=F32_RTOL)


@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (None, True), (4, True)])
def test_head_dim_64_layout_matches_upstream_hd64_reference(tpu_inference_refs, window, sinks):
  batch = _attention_batch(7, ATTENTION_REQUESTS, hq=4, hkv=2, d=64)
  sink = jnp.asarray(np.random.default_rng(8).normal(size=(4,)), jnp.float32) if sinks else None
  theirs = _jitted_over_concrete_metadata(
      tpu_inference_refs.ragged_paged_attention_hd64, *batch.args(), sink, sm_scale=0.125, sliding_window=window
  )
  ours = _jitted(rpa_lib.ragged_paged_attention, *batch.args(), sm_scale=0.125, sliding_window=window, sinks=sink)
  _check_attention(ours, theirs, batch)


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet: ragged conv1d, then the gated delta rule (upstream applies SiLU inside the rule, this package at
# the end of the conv).

NK, NV, DK, DV, WIDTH = 2, 4, 8, 6, 4
CONV_DIM = 2 * NK * DK + NV * DV


@dataclasses.dataclass
class GdnState:
  """Per-slot states of one GDN layer."""

  conv: jax.Array  # [M, K - 1, C]
  recurrent: jax.Array  # [M, nv, dk, dv] float32


@dataclasses.dataclass
class GdnStep:
  """One ragged GDN step: inputs and metadata."""

  x: jax.Array  # [T, C] conv input
  b: jax.Array
  a: jax.Array
  state_indices: jax.Array
  query_start_loc: jax.Array
  seq_lens: jax.Array
  distribution: jax.Array

  @property
  def num_valid_tokens(self) -> int:
    """Tokens of real requests."""
    return int(np.asarray(self.query_start_loc)[np.asarray(self.distribution)[2]])

  def has_initial_state(self) -> jax.Array:
    """The runner's rule: a request has a state to read when it had tokens before this step."""
    qsl = np.asarray(self.query_start_loc)
    return jnp.asarray((np.asarray(self.seq_lens) - (qsl[1:] - qsl[:-1])) > 0)


def _gdn_params(seed):
  rng = np.random.default_rng(seed)
  return {
      "weight": jnp.asarray(rng.normal(size=(CONV_DIM, 1, WIDTH)) * 0.5, jnp.float32),
      "bias": jnp.asarray(rng.normal(size=(CONV_DIM,)) * 0.1, jnp.float32),
      "A_log": jnp.asarray(rng.normal(size=(NV,)) * 0.5, jnp.float32),
      "dt_bias": jnp.asarray(rng.normal(size=(NV,)) * 0.5, jnp.float32),
  }


def _dirty_state(seed, num_slots) -> GdnState:
  rng = np.random.default_rng(seed)
  return GdnState(
      conv=jnp.asarray(rng.normal(size=(num_slots, WIDTH - 1, CONV_DIM)), jnp.float32),
      recurrent=jnp.asarray(rng.normal(size=(num_slots, NV, DK, DV)) * 0.5, jnp.float32),
  )


def _gdn_step(seed, requests, *, max_reqs=6, pad_tokens=3) -> GdnStep:
  """`requests`: (tokens seen before, new tokens, slot)."""
  rng = np.random.default_rng(seed)
  qsl = np.zeros(max_reqs + 1, np.int32)
  seq_lens = np.zeros(max_reqs, np.int32)
  slots = np.zeros(max_reqs, np.int32)
  for i, (prior, new, slot) in enumerate(requests):
    qsl[i + 1] = qsl[i] + new
    seq_lens[i] = prior + new
    slots[i] = slot
  qsl[len(requests) + 1 :] = qsl[len(requests)]
  num_tokens = int(qsl[-1]) + pad_tokens
  return GdnStep(
      x=jnp.asarray(rng.normal(size=(num_tokens, CONV_DIM)), jnp.float32),
      b=jnp.asarray(rng.normal(size=(num_tokens, NV)), jnp.float32),
      a=jnp.asarray(rng.normal(size=(num_tokens, NV)), jnp.float32),
      state_indices=jnp.asarray(slots),
      query_start_loc=jnp.asarray(qsl),
      seq_lens=jnp.asarray(seq_lens),
      distribution=jnp.asarray(_distribution([(p, n) for p, n, _ in requests])),
  )


def _upstream_gdn(refs, params, state: GdnState, step: GdnStep):
  """The wheel's two references chained as its GDN op chains its kernels; returns (silu(conv out), out, state)."""
  has_init = step.has_initial_state()
  conv_out, conv = _jitted(
      refs.ragged_conv1d,
      step.x,
      jnp.array(state.conv, copy=True),  # the reference donates its conv_state
      params["weight"],
      params["bias"],
      step.query_start_loc,
      step.state_indices,
      step.distribution,
      has_init,
      kernel_size=WIDTH,
  )
  recurrent, out = _jitted(
      refs.ragged_gated_delta_rule,
      conv_out,
      step.b,
      step.a,
      state.recurrent,
      params["A_log"],
      params["dt_bias"],
      step.query_start_loc,
      step.state_indices,
      step.distribution,
      has_init,
      n_kq=NK,
      n_v=NV,
      d_k=DK,
      d_v=DV,
  )
  return jax.nn.silu(conv_out), out, GdnState(conv=conv, recurrent=recurrent)


def _our_gdn(params, state: GdnState, step: GdnStep):
  meta = (step.state_indices, step.query_start_loc, step.seq_lens, step.distribution)
  y, conv = _jitted(conv_lib.ragged_conv1d, step.x, state.conv, params["weight"], params["bias"], *meta)
  t = y.shape[0]
  q = y[:, : NK * DK].reshape(t, NK, DK)
  k = y[:, NK * DK : 2 * NK * DK].reshape(t, NK, DK)
  v = y[:, 2 * NK * DK :].reshape(t, NV, DV)
  out, recurrent = _jitted(
      gdr_lib.ragged_gated_delta_rule, q, k, v, step.b, step.a, params["A_log"], params["dt_bias"], state.recurrent, *meta
  )
  return y, out.reshape(t, NV * DV), GdnState(conv=conv, recurrent=recurrent)


def _check_gdn(ours, theirs, step):
  (y, out, state), (ref_y, ref_out, ref_state) = ours, theirs
  n = step.num_valid_tokens
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), atol=F32_ATOL, rtol=F32_RTOL)
  np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref_out[:n]), atol=F32_ATOL, rtol=F32_RTOL)
  # Slot 0 is the null slot (see the module docstring); every other slot must agree.
  np.testing.assert_array_equal(np.asarray(state.conv[1:]), np.asarray(ref_state.conv[1:]))
  np.testing.assert_allclose(
      np.asarray(state.recurrent[1:]), np.asarray(ref_state.recurrent[1:]), atol=F32_ATOL, rtol=F32_RTOL
  )


# Decodes in dirty-looking but live slots, a fresh prefill landing on a stale slot, a chunked continuation, a
# one-token fresh request and a fresh prefill shorter than the conv window.
GDN_MIXED = ((6, 1, 4), (1, 1, 2), (0, 5, 7), (3, 4, 1), (0, 1, 5), (0, 2, 8))


@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_mixed_batch_matches_upstream_references(tpu_inference_refs, seed):
  params, state, step = _gdn_params(seed), _dirty_state(seed + 10, 9), _gdn_step(seed + 20, GDN_MIXED)
  _check_gdn(_our_gdn(params, state, step), _upstream_gdn(tpu_inference_refs, params, state, step), step)


def test_gdn_decode_only_batch_takes_upstreams_fast_path_and_matches(tpu_inference_refs):
  # distribution[0] == distribution[2]: the upstream conv takes its decode-only branch.
  params, state = _gdn_params(3), _dirty_state(13, 6)
  step = _gdn_step(23, ((3, 1, 2), (8, 1, 5), (1, 1, 1)), max_reqs=4, pad_tokens=2)
  assert tuple(np.asarray(step.distribution)) == (3, 3, 3)
  _check_gdn(_our_gdn(params, state, step), _upstream_gdn(tpu_inference_refs, params, state, step), step)


def test_gdn_chunked_prefill_over_steps_keeps_matching_upstream(tpu_inference_refs):
  # A 9-token prompt in chunks 4 + 3 + 2 beside a decoding request and a request that starts in step 2 on a stale
  # slot; each implementation carries its own states from step to step.
  params = _gdn_params(4)
  ours = theirs = _dirty_state(14, 7)
  schedule = [
      ((5, 1, 3), (0, 4, 6)),
      ((6, 1, 3), (4, 3, 6), (0, 2, 2)),
      ((7, 1, 3), (7, 2, 6), (2, 1, 2)),
  ]
  for i, requests in enumerate(schedule):
    step = _gdn_step(30 + i, requests, max_reqs=4)
    our_result = _our_gdn(params, ours, step)
    their_result = _upstream_gdn(tpu_inference_refs, params, theirs, step)
    _check_gdn(our_result, their_result, step)
    ours, theirs = our_result[2], their_result[2]
