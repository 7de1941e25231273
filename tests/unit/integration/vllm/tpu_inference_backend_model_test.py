"""Every tiny family through `kernel_backend=tpu_inference`, with a recording fake of tpu-inference's functions.

The model is built as the runner builds it (on a one-device mesh) while the fake's modules stand in for
tpu-inference; one runner step (a 7-token prefill, then a decode) must call the two upstream functions once per
layer of their kind, with 0.32.0's arguments (checked by the fake), the layer's scale and window, and
`update_kv_cache=False` exactly on KV-sharing layers, and give the hidden states the reference backend gives.
"""

import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.fake_tpu_inference import RecordingTpuInference
from maxtext.configs import load_config
from maxtext.kv_cache import kv_cache_spec
from maxtext.integration.vllm.adapter import MaxTextForCausalLM
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata

# Each family compiles two steps (two with the reference backend too): over 10 s on a 2-core CPU.
pytestmark = pytest.mark.slow

MAX_REQS = 4
NUM_BLOCKS = 8
BLOCK_SIZE = 4
FAMILIES = ("llama-tiny", "qwen3-tiny", "gemma3-tiny", "kvshare-tiny", "qwen3-next-tiny", "qwen3.5-tiny", "gpt-oss-tiny")
# The fake answers with the reference ops, so hidden states must equal the reference backend's; checked where a
# difference could hide (KV-sharing reads, GDN, attention sinks), the argument checks run for every family.
COMPARED = ("kvshare-tiny", "qwen3.5-tiny", "gpt-oss-tiny")
# Attention logit scale of each family, from its config: query_pre_attn_scalar ** -0.5 (gemma3: 24), else
# head_dim ** -0.5.
SCALES = {
    "llama-tiny": None,
    "qwen3-tiny": None,
    "gemma3-tiny": 24.0**-0.5,
    "kvshare-tiny": 24.0**-0.5,
    "qwen3-next-tiny": None,
    "qwen3.5-tiny": None,
    "gpt-oss-tiny": None,
}


# tpu-inference's GDN kernel takes head dims in whole 128-lane columns.
TPU_GDN = {"gdn_key_head_dim": 128, "gdn_value_head_dim": 128}


def _model(name, backend, fake=None):
  gdn = TPU_GDN if name in ("qwen3-next-tiny", "qwen3.5-tiny") else {}
  cfg = load_config(model_name=name, block_size=BLOCK_SIZE, kernel_backend=backend, **gdn)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  modules = {} if fake is None else fake.modules()
  with mock.patch.dict(sys.modules, modules):
    return MaxTextForCausalLM.from_config(cfg, jax.random.key(0), mesh)


def _caches(cfg):
  """One slot per cache-owning layer in layer order; KV-sharing layers map to their source's slot."""
  caches, slot_of = [], {}
  for i in range(cfg.base_num_decoder_layers):
    if cfg.kv_shared_source[i] >= 0:
      slot_of[i] = slot_of[cfg.kv_shared_source[i]]
      continue
    spec = kv_cache_spec.get_layer_spec(cfg, i)
    if isinstance(spec, kv_cache_spec.RecurrentSpec):
      caches.append(tuple(jnp.zeros(s, d) for s, d in zip(spec.cache_shapes(MAX_REQS + 1), spec.state_dtypes)))
    else:
      caches.append(jnp.zeros(spec.cache_shape(NUM_BLOCKS), spec.dtype))
    slot_of[i] = len(caches) - 1
  return caches, tuple((f"layer.{i}", slot) for i, slot in sorted(slot_of.items()))


def _metadata(cfg, num_new, seq_len):
  md = AttentionMetadata(
      input_positions=jnp.arange(seq_len - num_new, seq_len, dtype=jnp.int32),
      block_tables=jnp.asarray(np.arange(1, 1 + MAX_REQS * 2) % NUM_BLOCKS, jnp.int32),
      seq_lens=jnp.asarray([seq_len] + [0] * (MAX_REQS - 1), jnp.int32),
      query_start_loc=jnp.asarray([0] + [num_new] * MAX_REQS, jnp.int32),
      request_distribution=jnp.asarray([int(num_new == 1)] * 2 + [1], jnp.int32),
      mamba_state_indices=jnp.asarray([1] + [0] * (MAX_REQS - 1), jnp.int32),
      padded_num_reqs=MAX_REQS,
  )
  return GroupedAttentionMetadata([md], [[f"layer.{i}" for i in range(cfg.base_num_decoder_layers)]])


def _run(model, tokens_per_step):
  graphdef, state = nnx.split(model)

  caches, layer_map = _caches(model.cfg)

  @jax.jit
  def step(state, caches, ids, md):
    return nnx.merge(graphdef, state)(caches, ids, md, None, md.groups[0].input_positions, layer_map)

  hidden, seen = [], 0
  for tokens in tokens_per_step:
    seen += len(tokens)
    caches, h, _, _ = step(state, caches, jnp.asarray(tokens, jnp.int32), _metadata(model.cfg, len(tokens), seen))
    hidden.append(h)
  return hidden


@pytest.mark.parametrize("name", FAMILIES)
def test_family_calls_tpu_inference_per_layer_and_matches_the_reference(name):
  fake = RecordingTpuInference()
  ours = _model(name, "tpu_inference", fake)
  steps = ([5, 9, 200, 17, 3, 44, 81], [12])
  hidden = _run(ours, steps)
  if name in COMPARED:
    for h, ref in zip(hidden, _run(_model(name, "reference"), steps)):
      np.testing.assert_allclose(np.asarray(h), np.asarray(ref), atol=1e-5, rtol=1e-5)

  cfg = ours.cfg
  kinds = cfg.layer_types
  attention_layers = [i for i, k in enumerate(kinds) if k != "linear_attention"]
  gdn_layers = [i for i, k in enumerate(kinds) if k == "linear_attention"]
  rpa = fake.calls_to("sharded_ragged_paged_attention")
  gdn = fake.calls_to("run_jax_gdn_attention")
  # One trace per step shape (7 tokens, then 1): each traced once, every layer of a kind calls once per trace.
  assert len(rpa) == 2 * len(attention_layers) and len(gdn) == 2 * len(gdn_layers)
  scale = SCALES[name] or cfg.head_dim**-0.5
  for call, layer in zip(rpa, attention_layers * 2):
    args = call.args
    assert args["update_kv_cache"] is (cfg.kv_shared_source[layer] < 0), f"layer.{layer}"
    assert args["q"].shape[1:] == (cfg.base_num_query_heads, cfg.head_dim)
    assert args["k"].shape[1:] == (cfg.base_num_kv_heads, cfg.head_dim)
    assert args["attention_chunk_size"] == (cfg.sliding_window_size if kinds[layer] == "sliding_attention" else None)
    assert args["sm_scale"] == pytest.approx(scale)
    assert args["use_causal_mask"] is True
    if cfg.use_attention_sinks:  # fp32 [Hq] (traced; their values reach the hidden states compared above)
      sink = args["attention_sink"]
      assert sink.shape == (cfg.base_num_query_heads,) and sink.dtype == jnp.float32, f"layer.{layer}"
    else:
      assert args["attention_sink"] is None
  for call in gdn:
    args = call.args
    assert (args["n_kq"], args["n_v"], args["d_k"], args["d_v"], args["kernel_size"]) == (
        cfg.gdn_num_key_heads,
        cfg.gdn_num_value_heads,
        cfg.gdn_key_head_dim,
        cfg.gdn_value_head_dim,
        cfg.gdn_conv_kernel_dim,
    )
    assert args["recurrent_state"].dtype == jnp.float32
