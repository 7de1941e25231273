"""`kernel_backend=tpu_inference` against a recording fake of tpu-inference 0.32.0's two functions.

The fake (`support.fake_tpu_inference`) checks every call against 0.32.0's positional signatures and the
upstream kernels' shape and dtype rules, and answers with the reference ops (GDN shard by shard, as the upstream
`shard_map` does), so the results can be compared with the reference backend.
"""

import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.fake_tpu_inference import GDN_PARAMETERS, RPA_PARAMETERS, RecordingTpuInference
from maxtext.integration.vllm import tpu_inference_backend as tib
from maxtext.integration.vllm.environment import PluginEnvironmentError
from maxtext.kernels.backend import ReferenceBackend, get_backend
from maxtext.kv_cache.kv_cache_layout import get_kv_cache_shape

F32_TOL = 1e-5


def _mesh(model=1):
  return jax.sharding.Mesh(np.asarray(jax.devices()[:model]).reshape(1, model), ("data", "model"))


def _backend(model=1):
  fake = RecordingTpuInference()
  return tib.TpuInferenceBackend(_mesh(model), ops=tib.TpuInferenceOps(**_fake_ops(fake))), fake


def _fake_ops(fake):
  return {
      "sharded_ragged_paged_attention": fake.sharded_ragged_paged_attention,
      "run_jax_gdn_attention": fake.run_jax_gdn_attention,
  }


def _attention_inputs(seed=0, hq=4, hkv=2, d=32, cache_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  t, s, pages, bs = 7, 3, 3, 4
  cache = jnp.asarray(rng.normal(size=get_kv_cache_shape(10, bs, hkv, d, cache_dtype)), cache_dtype)
  return {
      "q": jnp.asarray(rng.normal(size=(t, hq, d)), jnp.float32),
      "k": jnp.asarray(rng.normal(size=(t, hkv, d)), jnp.float32),
      "v": jnp.asarray(rng.normal(size=(t, hkv, d)), jnp.float32),
      "kv_cache": cache,
      "kv_lens": jnp.asarray([6, 3, 0], jnp.int32),  # a decode and a 3-token prefill; one padded row
      "page_indices": jnp.asarray(rng.permutation(np.arange(1, 10))[: s * pages], jnp.int32),
      "cu_q_lens": jnp.asarray([0, 1, 4, 4], jnp.int32),
      "distribution": jnp.asarray([1, 1, 2], jnp.int32),
  }


def _positional(inputs):
  return [inputs[n] for n in ("q", "k", "v", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")]


@pytest.mark.slow
def test_attention_passes_0_32_0s_arguments_in_order_and_matches_the_reference():
  backend, fake = _backend()
  inputs = _attention_inputs()
  out, cache = backend.ragged_paged_attention(
      *_positional(inputs), None, 0.25, attention_chunk_size=5, attn_logits_soft_cap=30.0
  )
  (call,) = fake.calls_to("sharded_ragged_paged_attention")
  assert list(call.args) == list(RPA_PARAMETERS)
  assert call.args["mesh"] is backend.mesh
  assert (call.args["sm_scale"], call.args["attention_chunk_size"], call.args["attn_logits_soft_cap"]) == (0.25, 5, 30.0)
  assert (call.args["update_kv_cache"], call.args["use_causal_mask"], call.args["q_scale"]) == (True, True, None)
  ref_out, ref_cache = ReferenceBackend().ragged_paged_attention(
      *_positional(inputs), None, 0.25, attention_chunk_size=5, attn_logits_soft_cap=30.0
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=F32_TOL)
  np.testing.assert_array_equal(np.asarray(cache), np.asarray(ref_cache))


@pytest.mark.slow
def test_a_kv_sharing_read_sends_zero_kv_of_the_cache_heads_and_no_update():
  backend, fake = _backend()
  inputs = _attention_inputs(cache_dtype=jnp.bfloat16)
  args = _positional(inputs)
  args[1] = args[2] = None
  out, cache = backend.ragged_paged_attention(*args, None, 0.25, update_kv_cache=False, num_kv_heads=2)
  (call,) = fake.calls_to("sharded_ragged_paged_attention")
  assert call.args["update_kv_cache"] is False
  assert call.args["k"].shape == (7, 2, 32) and call.args["k"].dtype == jnp.bfloat16
  assert not np.any(np.asarray(call.args["k"], np.float32))
  np.testing.assert_array_equal(np.asarray(cache, np.float32), np.asarray(inputs["kv_cache"], np.float32))
  assert out.shape == (7, 4, 32)


def test_new_kv_is_cast_to_the_cache_dtype():
  backend, fake = _backend()
  backend.ragged_paged_attention(*_positional(_attention_inputs(cache_dtype=jnp.bfloat16)), None, 0.25)
  (call,) = fake.calls_to("sharded_ragged_paged_attention")
  assert call.args["k"].dtype == call.args["v"].dtype == jnp.bfloat16


def test_sinks_with_query_heads_the_hd64_kernel_cannot_pad_are_refused():
  """One bf16 query head per KV head: the upstream hd64 kernel pads the queries to pairs but not the sinks."""
  backend, fake = _backend()
  inputs = _attention_inputs(hq=4, hkv=4, d=64, cache_dtype=jnp.bfloat16)
  inputs["q"] = inputs["q"].astype(jnp.bfloat16)
  sinks = jnp.zeros((4,), jnp.float32)
  with pytest.raises(NotImplementedError, match=r"multiple of 2 query heads per KV head in bfloat16; .* 4 query heads"):
    backend.ragged_paged_attention(*_positional(inputs), sinks, 0.125)
  assert not fake.calls


def test_missing_kv_on_a_writing_call_is_an_error():
  backend, _ = _backend()
  args = _positional(_attention_inputs())
  args[1] = args[2] = None
  with pytest.raises(ValueError, match="k and v may be None only for a KV-sharing read"):
    backend.ragged_paged_attention(*args, None, 0.25, num_kv_heads=2)


# Head dims of 128: tpu-inference's GDN kernel takes whole 128-lane columns per head.
NK, NV, DK, DV, WIDTH = 2, 4, 128, 128, 4
CHANNELS = 2 * NK * DK + NV * DV


def _gdn_inputs(seed=0):
  rng = np.random.default_rng(seed)
  t, slots = 6, 5
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # pylint: disable=unnecessary-lambda-assignment
  return [
      f32(t, CHANNELS),  # mixed_qkv
      f32(t, NV),  # b
      f32(t, NV),  # a
      f32(slots, WIDTH - 1, CHANNELS),  # conv_state (stale slots)
      f32(slots, NV, DK, DV),  # recurrent_state
      f32(CHANNELS, 1, WIDTH) * 0.5,  # conv_weight
      None,  # conv_bias
      f32(NV),  # A_log
      f32(NV),  # dt_bias
      jnp.asarray([3, 1, 0], jnp.int32),  # state_indices: a decode, a fresh prefill on a stale slot, padding
      jnp.asarray([0, 1, 5, 5], jnp.int32),  # query_start_loc
      jnp.asarray([1, 1, 2], jnp.int32),  # distribution
      jnp.asarray([7, 4, 0], jnp.int32),  # seq_lens
      NK,
      NV,
      DK,
      DV,
      WIDTH,
  ]


@pytest.mark.slow
def test_gdn_passes_0_32_0s_arguments_in_order_and_matches_the_reference():
  backend, fake = _backend()
  args = _gdn_inputs()
  (conv, rec), out = backend.gdn_attention(*args)
  (call,) = fake.calls_to("run_jax_gdn_attention")
  assert list(call.args) == list(GDN_PARAMETERS)
  assert call.args["mesh"] is backend.mesh
  assert [call.args[n] for n in ("n_kq", "n_v", "d_k", "d_v", "kernel_size")] == [NK, NV, DK, DV, WIDTH]
  (ref_conv, ref_rec), ref_out = ReferenceBackend().gdn_attention(*args)
  np.testing.assert_allclose(np.asarray(out[:5]), np.asarray(ref_out[:5]), atol=F32_TOL)
  np.testing.assert_array_equal(np.asarray(conv), np.asarray(ref_conv))
  np.testing.assert_allclose(np.asarray(rec), np.asarray(ref_rec), atol=F32_TOL)


@pytest.mark.slow
def test_gdn_channels_are_laid_out_per_tensor_parallel_shard():
  # Two head shards: the fake splits channels and heads in halves as the upstream shard_map does; the result must
  # still be the unsharded reference's, with the conv state kept in the per-shard channel order.
  backend, fake = _backend(model=2)
  args = _gdn_inputs(1)
  order = tib.per_shard_channel_order(NK, NV, DK, DV, 2)
  # Shard 0: q heads 0, k heads 0, v heads 0-1; shard 1: the others (DK = DV = 128; k starts at 256, v at 512).
  expected = np.r_[0:128, 256:384, 512:768, 128:256, 384:512, 768:1024]
  np.testing.assert_array_equal(order, expected)
  sharded_args = list(args)
  sharded_args[3] = args[3][:, :, order]  # the runner's conv state is kept in the kernel's (per-shard) order
  (conv, rec), out = backend.gdn_attention(*sharded_args)
  (call,) = fake.calls_to("run_jax_gdn_attention")
  np.testing.assert_array_equal(np.asarray(call.args["mixed_qkv"]), np.asarray(args[0][:, order]))
  np.testing.assert_array_equal(np.asarray(call.args["conv_weight"]), np.asarray(args[5][order]))
  (ref_conv, ref_rec), ref_out = ReferenceBackend().gdn_attention(*args)
  np.testing.assert_allclose(np.asarray(out[:5]), np.asarray(ref_out[:5]), atol=F32_TOL)
  np.testing.assert_array_equal(np.asarray(conv), np.asarray(ref_conv[:, :, order]))
  np.testing.assert_allclose(np.asarray(rec), np.asarray(ref_rec), atol=F32_TOL)


@pytest.mark.parametrize("d_k, d_v", [(16, 128), (128, 24)])
def test_gdn_head_dims_the_upstream_kernel_cannot_take_are_refused_by_name(d_k, d_v):
  backend, fake = _backend()
  args = _gdn_inputs()
  args[15], args[16] = d_k, d_v
  with pytest.raises(ValueError, match=rf"gdn_key_head_dim and gdn_value_head_dim .* multiples of 128 .*; got {d_k} and"):
    backend.gdn_attention(*args)
  assert not fake.calls


def test_gdn_heads_that_do_not_split_over_the_shards_are_an_error():
  with pytest.raises(ValueError, match=r"key heads \(2\) and value heads \(4\) must both be multiples of .* \(4\)"):
    tib.per_shard_channel_order(2, 4, 8, 6, 4)


def test_the_backend_needs_a_mesh():
  with pytest.raises(ValueError, match="needs the runner's device mesh"):
    tib.TpuInferenceBackend(None, ops=tib.TpuInferenceOps(**_fake_ops(RecordingTpuInference())))


def test_selecting_it_without_tpu_inference_names_the_package():
  with mock.patch.dict(sys.modules, {"tpu_inference": None, tib.ATTENTION_MODULE: None}):
    with pytest.raises(PluginEnvironmentError, match="kernel_backend=tpu_inference needs the tpu-inference package"):
      get_backend("tpu_inference", _mesh())


def test_selecting_it_imports_the_two_upstream_functions():
  fake = RecordingTpuInference()
  with mock.patch.dict(sys.modules, fake.modules()):
    backend = get_backend("tpu_inference", _mesh())
  assert isinstance(backend, tib.TpuInferenceBackend)
  assert backend.ops == tib.TpuInferenceOps(**_fake_ops(fake))


def test_a_tpu_inference_without_the_function_is_an_error():
  fake = RecordingTpuInference()
  modules = fake.modules()
  del modules[tib.GDN_MODULE].run_jax_gdn_attention
  with mock.patch.dict(sys.modules, modules):
    with pytest.raises(PluginEnvironmentError, match="gdn_attention has no callable run_jax_gdn_attention"):
      get_backend("tpu_inference", _mesh())


def _moe_inputs():
  rng = np.random.default_rng(3)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # pylint: disable=unnecessary-lambda-assignment
  indices = jnp.asarray(rng.integers(0, 4, size=(6, 2)), jnp.int32)
  return f32(6, 8), jax.nn.softmax(f32(6, 2)), indices, f32(4, 8, 16), f32(4, 8, 16), f32(4, 16, 8)


@pytest.mark.parametrize("asked, primitive", [("tiled", "ragged_dot"), ("dense", "dot_general")])
def test_routed_experts_run_as_one_grouped_matmul_where_the_layer_asks_for_the_default(asked, primitive):
  """A TPU has a native grouped matmul, so the default `tiled` loop becomes `ragged_dot`; other forms pass as asked."""
  backend, _ = _backend()
  args = _moe_inputs()

  def run(*arrays):
    return backend.moe_experts(*arrays, activation=jax.nn.silu, dtype=jnp.float32, method=asked)

  jaxpr = str(jax.make_jaxpr(run)(*args))
  assert primitive in jaxpr
  assert asked != "tiled" or "while" not in jaxpr  # not the tile loop
  expected = ReferenceBackend().moe_experts(*args, activation=jax.nn.silu, dtype=jnp.float32, method="dense")
  np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(expected), atol=F32_TOL, rtol=F32_TOL)
