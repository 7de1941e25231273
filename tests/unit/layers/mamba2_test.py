"""The Mamba2 mixer: its two scan forms, the float64 reference, state continuation, the paged op, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import reference
from maxtext.configs import ConfigError, load_config
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.kernels.backend import default_backend
from maxtext.kernels.ragged_mamba2 import ragged_mamba2
from maxtext.layers.mamba2 import Mamba2, grouped_gated_rms_norm, ssd_chunked, ssd_recurrent

D, NH, HD, N, G, K = 32, 4, 8, 6, 2, 4
EPS = 1e-6
LIMIT = (0.05, 1.5)  # binds: softplus of the random dt spans both sides


@pytest.fixture(name="mixer", scope="module")
def _mixer():
  """A Mamba2 with biases, a binding time-step clamp and non-trivial A_log / D / dt_bias / norm weights."""
  m = Mamba2(
      emb_dim=D,
      num_heads=NH,
      head_dim=HD,
      state_dim=N,
      num_groups=G,
      conv_kernel_dim=K,
      conv_bias=True,
      proj_bias=True,
      chunk_size=4,
      time_step_limit=LIMIT,
      norm_eps=EPS,
      rngs=nnx.Rngs(0),
  )
  rng = np.random.default_rng(0)
  for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    if var.get_value().ndim == 1:
      var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape) * 0.5 + (1.0 if path[0] == "norm" else 0.0)))
  return m


def _x(t, seed=1, b=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, D)), jnp.float32)


@pytest.mark.slow
def test_chunked_and_recurrent_scans_agree_with_the_float64_reference(mixer):
  x = _x(11)  # 11 tokens: two full chunks of 4 and a padded one
  chunked = np.asarray(mixer(x, chunked=True)[0][0])
  recurrent = np.asarray(mixer(x, chunked=False)[0][0])
  ref = reference.mamba2(
      np.asarray(x[0]), reference.module_params(mixer), "", nh=NH, hd=HD, n=N, g=G, eps=EPS, dt_limit=LIMIT
  )
  np.testing.assert_allclose(chunked, recurrent, atol=2e-5, rtol=0)
  np.testing.assert_allclose(chunked, ref, atol=2e-5, rtol=0)
  np.testing.assert_allclose(recurrent, ref, atol=2e-5, rtol=0)
  print(f"\nmamba2: max |chunked - f64| = {np.abs(chunked - ref).max():.1e}, |recurrent - f64| = "
        f"{np.abs(recurrent - ref).max():.1e}")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [True, False])
def test_continuing_from_the_returned_state_equals_one_pass(mixer, chunked):
  x = _x(13, seed=2, b=2)
  full, conv_full, ssm_full = mixer.forward_with_state(x, chunked=chunked)
  first, conv, ssm = mixer.forward_with_state(x[:, :6], chunked=chunked)
  second, conv, ssm = mixer.forward_with_state(x[:, 6:], conv, ssm, chunked=chunked)
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, atol=2e-5, rtol=0)
  np.testing.assert_allclose(ssm, ssm_full, atol=2e-5, rtol=0)
  np.testing.assert_array_equal(conv, conv_full)


@pytest.mark.slow
def test_scan_forms_agree_on_random_inputs_across_chunk_sizes():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 10, 3, 5)), jnp.float32)
  delta = jnp.asarray(rng.uniform(0.01, 2.0, size=(2, 10, 3)), jnp.float32)
  a = -jnp.asarray([0.5, 1.0, 3.0], jnp.float32)
  b, c = (jnp.asarray(rng.normal(size=(2, 10, 3, 4)), jnp.float32) for _ in range(2))
  s0 = jnp.asarray(rng.normal(size=(2, 3, 5, 4)), jnp.float32)
  y_ref, s_ref = ssd_recurrent(x, delta, a, b, c, initial_state=s0)
  for chunk in (1, 3, 10, 16):
    y, s = ssd_chunked(x, delta, a, b, c, chunk_size=chunk, initial_state=s0)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0, err_msg=f"chunk {chunk}")
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=0, err_msg=f"chunk {chunk}")


def test_the_norm_gates_before_normalising_per_group():
  rng = np.random.default_rng(4)
  y, z = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))
  w = rng.normal(size=8)
  got = np.asarray(grouped_gated_rms_norm(jnp.asarray(y), jnp.asarray(z), jnp.asarray(w), groups=2, eps=EPS))
  gated = (y * reference.silu(z)).reshape(3, 2, 4)
  want = (gated / np.sqrt(np.mean(gated**2, -1, keepdims=True) + EPS)).reshape(3, 8) * w
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  norm_first = reference.rms_norm(y.reshape(3, 2, 4), np.ones(4), EPS, False).reshape(3, 8) * w * reference.silu(z)
  assert np.abs(got - norm_first).max() > 1e-2  # the other order is a different function


def _metadata(qsl, seq_lens, slots, num_reqs):
  t = qsl[-1]
  return AttentionMetadata(
      input_positions=jnp.arange(t, dtype=jnp.int32),
      block_tables=None,
      seq_lens=jnp.asarray(seq_lens, jnp.int32),
      query_start_loc=jnp.asarray(qsl, jnp.int32),
      request_distribution=jnp.asarray([0, 0, num_reqs], jnp.int32),
      mamba_state_indices=jnp.asarray(slots, jnp.int32),
      padded_num_reqs=len(slots),
  )


@pytest.mark.slow
def test_paged_op_continues_each_request_from_its_slot_and_starts_new_ones_from_zero(mixer):
  """A ragged step: request 0 continues (6 earlier tokens in slot 2), request 1 is new (slot 1 holds garbage),
  plus a padded request row pointing at the null slot and 3 padded tokens."""
  x = _x(12, seed=5, b=2)
  _, conv0, ssm0 = mixer.forward_with_state(x[:1, :6])
  rng = np.random.default_rng(6)
  conv_state = jnp.asarray(rng.normal(size=(4, K - 1, mixer.conv_dim)), jnp.float32)
  ssm_state = jnp.asarray(rng.normal(size=(4, NH, HD, N)), jnp.float32)
  conv_state, ssm_state = conv_state.at[2].set(conv0[0]), ssm_state.at[2].set(ssm0[0])
  flat = jnp.concatenate([x[0, 6:11], x[1, :4], jnp.zeros((3, D))])  # 5 + 4 real tokens, 3 padded
  md = _metadata([0, 5, 9, 9], [11, 4, 0], [2, 1, 0], num_reqs=2)
  out, (conv_new, ssm_new) = mixer.paged(flat, md.input_positions, (conv_state, ssm_state), md, default_backend())
  want0, conv_w0, ssm_w0 = mixer.forward_with_state(x[:1, :11], chunked=False)
  want1, conv_w1, ssm_w1 = mixer.forward_with_state(x[1:, :4], chunked=False)
  np.testing.assert_allclose(out[:5], want0[0, 6:], atol=2e-5, rtol=0)
  np.testing.assert_allclose(out[5:9], want1[0], atol=2e-5, rtol=0)
  np.testing.assert_allclose(ssm_new[2], ssm_w0[0], atol=2e-5, rtol=0)
  np.testing.assert_allclose(ssm_new[1], ssm_w1[0], atol=2e-5, rtol=0)
  np.testing.assert_allclose(conv_new[2], conv_w0[0], atol=1e-6, rtol=0)
  np.testing.assert_allclose(conv_new[1], conv_w1[0], atol=1e-6, rtol=0)
  # The null slot and the unused slot are untouched.
  np.testing.assert_array_equal(ssm_new[0], ssm_state[0])
  np.testing.assert_array_equal(ssm_new[3], ssm_state[3])


def test_layer_spec_and_metadata_errors():
  cfg = load_config(model_name="bamba-tiny")
  spec = Mamba2.cache_spec(cfg, 0)
  assert spec.state_names == ("conv", "ssm") and spec.state_dtypes == ("float32", "float32")
  assert spec.state_shapes == ((3, cfg.mamba_conv_dim), (8, 16, 16))
  assert cfg.mamba_conv_dim == 8 * 16 + 2 * 1 * 16
  m = Mamba2.from_config(cfg, 0, rngs=nnx.Rngs(0))
  md = dataclasses.replace(_metadata([0, 2], [2], [1], 1), mamba_state_indices=None)
  state = tuple(jnp.zeros(s) for s in spec.cache_shapes(2))
  with pytest.raises(ValueError, match="a mamba layer: a recurrent layer needs attention_metadata.mamba_state_indices"):
    m.paged(jnp.zeros((2, cfg.base_emb_dim)), jnp.arange(2), state, md, default_backend())
  with pytest.raises(ValueError, match="cannot take shared K/V"):
    m(jnp.zeros((1, 2, cfg.base_emb_dim)), None, (jnp.zeros(1), jnp.zeros(1)))
  with pytest.raises(ValueError, match=r"mamba heads \(6\) must be a positive multiple of groups \(4\)"):
    Mamba2(emb_dim=8, num_heads=6, head_dim=2, state_dim=2, num_groups=4, conv_kernel_dim=4, rngs=nnx.Rngs(0))


def test_ragged_op_checks_shapes_and_state_dtype():
  t, s = 3, 2
  args = {
      "x": jnp.zeros((t, NH, HD)),
      "dt": jnp.zeros((t, NH)),
      "b": jnp.zeros((t, G, N)),
      "c": jnp.zeros((t, G, N)),
      "A_log": jnp.zeros(NH),
      "D": jnp.zeros(NH),
      "dt_bias": jnp.zeros(NH),
      "ssm_state": jnp.zeros((3, NH, HD, N)),
      "state_indices": jnp.zeros(s, jnp.int32),
      "query_start_loc": jnp.asarray([0, 1, 3], jnp.int32),
      "seq_lens": jnp.asarray([1, 2], jnp.int32),
      "distribution": jnp.asarray([0, 0, 2], jnp.int32),
  }
  ragged_mamba2(**args)
  with pytest.raises(ValueError, match=r"dt must be \[T, nh\] = \(3, 4\)"):
    ragged_mamba2(**{**args, "dt": jnp.zeros((t, NH + 1))})
  with pytest.raises(TypeError, match="ssm_state must be float32"):
    ragged_mamba2(**{**args, "ssm_state": jnp.zeros((3, NH, HD, N), jnp.bfloat16)})
  with pytest.raises(ValueError, match="time_step_limit must be"):
    ragged_mamba2(**args, time_step_limit=(1.0, 0.5))


def test_config_rules_of_the_mamba_kind():
  with pytest.raises(ConfigError, match="layer 0 is mamba, which needs decoder_block in granite_hybrid, bamba"):
    load_config(model_name="llama-tiny", layer_types=["mamba"] + ["full_attention"] * 3)
  with pytest.raises(ConfigError, match="mamba_num_heads=6: must be divisible by mamba_num_groups=4"):
    load_config(model_name="bamba-tiny", mamba_num_heads=6, mamba_num_groups=4)
  with pytest.raises(ConfigError, match=r"mamba_time_step_max=0.1: must be 0 \(no limit\) or >= mamba_time_step_min"):
    load_config(model_name="bamba-tiny", mamba_time_step_min=0.5, mamba_time_step_max=0.1)


def test_tpu_inference_backend_refuses_mamba_layers():
  from maxtext.integration.vllm import tpu_inference_backend  # pylint: disable=import-outside-toplevel

  backend = object.__new__(tpu_inference_backend.TpuInferenceBackend)  # no tpu-inference here: skip __init__
  with pytest.raises(NotImplementedError, match="kernel_backend=tpu_inference cannot run mamba layers"):
    backend.mamba2_attention(*([None] * 19))


@pytest.mark.slow
def test_dense_forward_is_jittable(mixer):
  x = _x(5)
  np.testing.assert_allclose(jax.jit(lambda v: mixer(v)[0])(x), mixer(x)[0], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_paged_op_under_prefix_caching_reads_one_state_block_and_writes_another(mixer):
  """The align scheme: with block tables and no compact slots, request 0 (6 tokens computed, 5 new, 4 tokens per
  state block) reads its state from the block of token 5 and writes the block of token 10; the read block keeps
  its checkpoint. Request 1 is new and starts from zeros."""
  x = _x(12, seed=5, b=2)
  _, conv0, ssm0 = mixer.forward_with_state(x[:1, :6])
  rng = np.random.default_rng(7)
  conv_state = jnp.asarray(rng.normal(size=(5, K - 1, mixer.conv_dim)), jnp.float32)
  ssm_state = jnp.asarray(rng.normal(size=(5, NH, HD, N)), jnp.float32)
  conv_state, ssm_state = conv_state.at[2].set(conv0[0]), ssm_state.at[2].set(ssm0[0])
  flat = jnp.concatenate([x[0, 6:11], x[1, :4], jnp.zeros((3, D))])
  md = dataclasses.replace(
      _metadata([0, 5, 9, 9], [11, 4, 0], [0, 0, 0], num_reqs=2),
      mamba_state_indices=None,
      block_tables=jnp.asarray([4, 2, 3, 1, 0, 0, 0, 0, 0], jnp.int32),  # 3 requests x 3 state blocks
  )
  saved = mixer.mamba_block_size
  mixer.mamba_block_size = 4
  try:
    out, (conv_new, ssm_new) = mixer.paged(flat, md.input_positions, (conv_state, ssm_state), md, default_backend())
  finally:
    mixer.mamba_block_size = saved
  want0, conv_w0, ssm_w0 = mixer.forward_with_state(x[:1, :11], chunked=False)
  want1, _, ssm_w1 = mixer.forward_with_state(x[1:, :4], chunked=False)
  np.testing.assert_allclose(out[:5], want0[0, 6:], atol=2e-5, rtol=0)
  np.testing.assert_allclose(out[5:9], want1[0], atol=2e-5, rtol=0)
  np.testing.assert_allclose(ssm_new[3], ssm_w0[0], atol=2e-5, rtol=0)
  np.testing.assert_allclose(conv_new[3], conv_w0[0], atol=1e-6, rtol=0)
  np.testing.assert_allclose(ssm_new[1], ssm_w1[0], atol=2e-5, rtol=0)
  np.testing.assert_array_equal(ssm_new[2], ssm_state[2])  # the checkpoint read from is kept
  np.testing.assert_array_equal(conv_new[2], conv_state[2])
