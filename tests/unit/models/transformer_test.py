"""The hybrid Transformer on every tiny family, against the float64 NumPy reference decoder; parameter counts."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.param_checks import param_count
from support.reference import model_forward
from maxtext.configs import load_config
from maxtext.models import Transformer, abstract_model, get_flat_params

TINY = ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "qwen3-next-tiny", "qwen3.5-tiny", "kvshare-tiny", "gpt-oss-tiny"]
HYBRID = ("qwen3-next-tiny", "qwen3.5-tiny")
T = 21  # longer than the sliding window (8) and the GDN chunk (8), not a multiple of either

QK_NORM = ("qwen3", "gemma3", "qwen3_next", "qwen3_5")
GATED = ("qwen3_next", "qwen3_5")


def _forward(model, tokens, positions=None):
  return model(tokens, positions)


FORWARD = nnx.jit(_forward)


def _add_noise(model, seed):
  """HF-style inits leave (1+w) norms at 0 and biases at 0: perturb every 1-D parameter and every bias so those
  paths matter."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = var.get_value()
    if value.ndim == 1 or str(path[-1]).endswith("bias"):
      var.set_value(value + jnp.asarray(rng.normal(size=value.shape) * 0.3, value.dtype))


@functools.lru_cache(maxsize=None)
def _built(name):
  """Model (with noisy 1-D params), tokens [2, T] and logits of a tiny family, built once per test session."""
  cfg = load_config(model_name=name)
  model = Transformer(cfg, rngs=nnx.Rngs(cfg.init_seed))
  _add_noise(model, 0)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, T)).astype(np.int32)
  logits = FORWARD(model, jnp.asarray(tokens))
  return name, cfg, model, tokens, logits


@pytest.fixture(name="family", params=TINY)
def _family(request):
  """(name, cfg, model, tokens, logits) of each tiny family."""
  return _built(request.param)


def expected_param_shapes(cfg):
  """Canonical names and shapes of the parameter table in docs/architecture.md, for the layer kinds of `cfg`."""
  d, v, hq, hkv, dh = cfg.base_emb_dim, cfg.vocab_size, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
  nk, nv, hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
  c = 2 * nk * hk + nv * hv
  block = cfg.decoder_block
  out = {"embedder.embedding": (v, d), "final_norm.scale": (d,)}
  if not cfg.logits_via_embedding:
    out["lm_head.kernel"] = (d, v)
  for i, kind in enumerate(cfg.layer_types):
    p = f"layers.{i}."
    out[p + "input_norm.scale"] = (d,)
    out[p + "pre_mlp_norm.scale"] = (d,)
    if block == "gemma3":
      out[p + "post_attn_norm.scale"] = (d,)
      out[p + "post_mlp_norm.scale"] = (d,)
    if kind == "linear_attention":
      out.update(
          {
              p + "gdn.qkv.kernel": (d, c),
              p + "gdn.z.kernel": (d, nv * hv),
              p + "gdn.b.kernel": (d, nv),
              p + "gdn.a.kernel": (d, nv),
              p + "gdn.conv.kernel": (cfg.gdn_conv_kernel_dim, c),
              p + "gdn.A_log": (nv,),
              p + "gdn.dt_bias": (nv,),
              p + "gdn.norm.scale": (hv,),
              p + "gdn.out.kernel": (nv * hv, d),
          }
      )
    else:
      shared = cfg.kv_shared_source[i] >= 0
      out[p + "attn.q.kernel"] = (d, hq, dh)
      out[p + "attn.o.kernel"] = (hq, dh, d)
      if block in GATED:
        out[p + "attn.gate.kernel"] = (d, hq, dh)
      if not shared:
        out[p + "attn.k.kernel"] = (d, hkv, dh)
        out[p + "attn.v.kernel"] = (d, hkv, dh)
      if cfg.attention_bias:
        out[p + "attn.q.bias"] = (hq, dh)
        out[p + "attn.o.bias"] = (d,)
        if not shared:
          out[p + "attn.k.bias"] = (hkv, dh)
          out[p + "attn.v.bias"] = (hkv, dh)
      if block == "gpt_oss":
        out[p + "attn.sinks"] = (hq,)
      if block in QK_NORM:
        out[p + "attn.q_norm.scale"] = (dh,)
        if not shared:
          out[p + "attn.k_norm.scale"] = (dh,)
    if cfg.moe_layers[i]:
      e, fe, fs = cfg.num_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_mlp_dim
      out.update(
          {
              p + "moe.router.kernel": (d, e),
              p + "moe.gate": (e, d, fe),
              p + "moe.up": (e, d, fe),
              p + "moe.down": (e, fe, d),
          }
      )
      if block == "gpt_oss":
        out.update(
            {
                p + "moe.router.bias": (e,),
                p + "moe.gate_bias": (e, fe),
                p + "moe.up_bias": (e, fe),
                p + "moe.down_bias": (e, d),
            }
        )
      if fs > 0:
        out.update(
            {
                p + "moe.shared.gate.kernel": (d, fs),
                p + "moe.shared.up.kernel": (d, fs),
                p + "moe.shared.down.kernel": (fs, d),
                p + "moe.shared_gate.kernel": (d, 1),
            }
        )
    else:
      f = cfg.base_mlp_dim
      out.update({p + "mlp.gate.kernel": (d, f), p + "mlp.up.kernel": (d, f), p + "mlp.down.kernel": (f, d)})
      if cfg.mlp_bias:
        out.update({p + "mlp.gate.bias": (f,), p + "mlp.up.bias": (f,), p + "mlp.down.bias": (d,)})
  return out


def test_forward_is_finite_and_matches_float64_reference(family):
  name, cfg, model, tokens, logits = family
  assert logits.shape == (2, T, cfg.vocab_size) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  params = {k: np.asarray(v) for k, v in get_flat_params(model).items()}
  # Hybrids: the gated RMSNorm of GDN outputs with tiny RMS amplifies rounding; the float64 reference itself
  # moves by ~3e-4 when its parameters are perturbed by 1e-7 (relative), so fp32 can only match that closely.
  atol = 1e-3 if name in HYBRID else 3e-5
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits[b]), model_forward(cfg, params, tokens[b]), atol=atol)


@pytest.mark.slow
def test_biases_and_soft_caps_match_float64_reference():
  cfg = load_config(
      model_name="qwen3-tiny",
      attention_bias=True,
      mlp_bias=True,
      attn_logits_soft_cap=3.0,
      final_logits_soft_cap=5.0,
      logits_via_embedding=False,
  )
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  _add_noise(model, 3)
  assert {k: tuple(v.shape) for k, v in get_flat_params(model).items()} == expected_param_shapes(cfg)
  tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(1, 15)).astype(np.int32)
  logits = np.asarray(FORWARD(model, jnp.asarray(tokens)))[0]
  assert np.abs(logits).max() < 5.0
  params = {k: np.asarray(v) for k, v in get_flat_params(model).items()}
  np.testing.assert_allclose(logits, model_forward(cfg, params, tokens[0]), atol=3e-5)


@pytest.mark.slow
def test_forward_is_causal(family):
  _, cfg, model, tokens, logits = family
  changed = tokens.copy()
  changed[:, 13] = (changed[:, 13] + 1) % cfg.vocab_size
  other = FORWARD(model, jnp.asarray(changed))
  np.testing.assert_allclose(np.asarray(other[:, :13]), np.asarray(logits[:, :13]), atol=1e-6)
  assert np.all(np.abs(np.asarray(other[:, 13:] - logits[:, 13:])).max(-1) > 1e-4)


@pytest.mark.slow
def test_parameter_names_and_shapes_match_interfaces(family):
  _, cfg, model, _, _ = family
  got = {k: tuple(v.shape) for k, v in get_flat_params(model).items()}
  assert got == expected_param_shapes(cfg)


@pytest.mark.slow
def test_param_count_equals_sum_of_parameter_sizes(family):
  _, cfg, model, _, _ = family
  assert param_count(cfg) == sum(int(np.prod(v.shape)) for v in get_flat_params(model).values())


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_bfloat16_weight_dtype_gives_bfloat16_params(name):
  model = abstract_model(load_config(model_name=name, weight_dtype="bfloat16"))
  dtypes = {v.dtype for v in get_flat_params(model).values()}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}


def test_init_is_seeded():
  cfg = load_config(model_name="llama-tiny")
  a = get_flat_params(Transformer(cfg, rngs=nnx.Rngs(0)))["layers.0.attn.q.kernel"]
  b = get_flat_params(Transformer(cfg, rngs=nnx.Rngs(0)))["layers.0.attn.q.kernel"]
  c = get_flat_params(Transformer(cfg, rngs=nnx.Rngs(1)))["layers.0.attn.q.kernel"]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(a), np.asarray(c))


def test_positions_default_to_arange_and_are_used():
  _, _, model, tokens, logits = _built("llama-tiny")
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  np.testing.assert_array_equal(np.asarray(FORWARD(model, jnp.asarray(tokens), pos)), np.asarray(logits))
  shifted = FORWARD(model, jnp.asarray(tokens), pos + 5)  # RoPE is relative: a common shift changes nothing
  np.testing.assert_allclose(np.asarray(shifted), np.asarray(logits), atol=2e-5)
  stretched = FORWARD(model, jnp.asarray(tokens), pos * 2)
  assert float(jnp.abs(stretched[:, 1:] - logits[:, 1:]).max(-1).min()) > 1e-3


def test_kv_shared_layers_read_their_source_layers_kv():
  _, cfg, model, tokens, _ = _built("kvshare-tiny")
  assert cfg.kv_shared_source == (-1, -1, -1, -1, 3, 2)
  for shared, source in ((4, 3), (5, 2)):
    assert model.layers[shared].attn.k is None and model.layers[shared].attn.v is None
    # Silence the source layer's own contribution to the residual stream: its K/V then only reach the logits
    # through the shared layer.
    probe = nnx.clone(model)
    src_attn = probe.layers[source].attn
    src_attn.o.kernel[...] = jnp.zeros_like(src_attn.o.kernel[...])
    base = FORWARD(probe, jnp.asarray(tokens))
    src_attn.k.kernel[...] = src_attn.k.kernel[...] + 0.2  # additive: k_norm would undo a scaling
    assert float(jnp.abs(FORWARD(probe, jnp.asarray(tokens)) - base).max()) > 1e-3
  # Control: a layer nobody shares from, silenced the same way, has no effect through its K.
  probe = nnx.clone(model)
  attn1 = probe.layers[1].attn
  attn1.o.kernel[...] = jnp.zeros_like(attn1.o.kernel[...])
  base = FORWARD(probe, jnp.asarray(tokens))
  attn1.k.kernel[...] = attn1.k.kernel[...] + 0.2
  np.testing.assert_allclose(np.asarray(FORWARD(probe, jnp.asarray(tokens))), np.asarray(base), atol=1e-6)


def test_tied_head_and_final_soft_cap():
  cfg = load_config(model_name="gemma3-tiny", final_logits_soft_cap=2.0)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert model.lm_head is None
  hidden = np.random.default_rng(2).normal(size=(3, cfg.base_emb_dim)).astype(np.float32)
  emb = np.asarray(model.embedder.embedding[...], np.float64)
  ref = 2.0 * np.tanh(hidden.astype(np.float64) @ emb.T / 2.0)
  np.testing.assert_allclose(np.asarray(model.compute_logits(jnp.asarray(hidden))), ref, atol=1e-5)
  scaled = model.embed(jnp.array([5]))
  np.testing.assert_allclose(np.asarray(scaled[0]), emb[5] * np.float32(np.sqrt(96)), rtol=1e-6)


def test_untied_head():
  cfg = load_config(model_name="llama-tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  hidden = np.random.default_rng(3).normal(size=(2, cfg.base_emb_dim)).astype(np.float32)
  ref = hidden.astype(np.float64) @ np.asarray(model.lm_head.kernel[...], np.float64)
  np.testing.assert_allclose(np.asarray(model.compute_logits(jnp.asarray(hidden))), ref, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(model.embed(jnp.array([3]))[0]), np.asarray(model.embedder.embedding[3]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-tiny", "qwen3.5-tiny"])
def test_bfloat16_compute_tracks_float32(name):
  m32 = Transformer(load_config(model_name=name), rngs=nnx.Rngs(0))
  m16 = Transformer(load_config(model_name=name, dtype="bfloat16", weight_dtype="bfloat16"), rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 512, size=(1, 12)), jnp.int32)
  out16 = FORWARD(m16, tokens)
  assert out16.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out16)))
  out16, out32 = np.asarray(out16, np.float32), np.asarray(FORWARD(m32, tokens))
  if name == "gemma3-tiny":
    np.testing.assert_allclose(out16, out32, atol=0.15)
  else:
    # Random-init GDN models are ill-conditioned (gated-norm inputs with tiny RMS): the float64 reference moves by
    # ~5 under 2e-3 relative parameter noise, so bf16 can only track fp32 loosely.
    assert np.corrcoef(out16.ravel(), out32.ravel())[0, 1] > 0.95


def test_input_shape_errors():
  model = Transformer(load_config(model_name="llama-tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"tokens must have shape \[B, T\], got \(4,\)"):
    model(jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match=r"positions must have shape \(1, 4\) \(like tokens\), got \(4,\)"):
    model(jnp.zeros((1, 4), jnp.int32), jnp.arange(4))
  with pytest.raises(ValueError, match=r"decode_hidden expects embeddings \[B, T, D\], got shape \(4, 64\)"):
    model.decode_hidden(jnp.zeros((4, 64)))


# Published configurations (config.json of each Hub model), written out here so the expected totals do not
# depend on the YAML files or on the model code.
def _attn(d, hq, hkv, dh, *, qk_norm, gate):
  return d * hq * dh * (2 if gate else 1) + 2 * d * hkv * dh + hq * dh * d + (2 * dh if qk_norm else 0)


def _gdn(d, nk, nv, hk, hv, k):
  conv_dim = 2 * nk * hk + nv * hv
  return d * conv_dim + d * nv * hv + 2 * d * nv + k * conv_dim + 2 * nv + hv + nv * hv * d


def _moe(d, e, fe, fs):
  return d * e + 3 * e * d * fe + 3 * d * fs + d


def _expected_llama31_8b():
  d, layers, v = 4096, 32, 128256
  per_layer = _attn(d, 32, 8, 128, qk_norm=False, gate=False) + 3 * d * 14336 + 2 * d
  return 2 * v * d + d + layers * per_layer


def _expected_qwen3_8b():
  d, layers, v = 4096, 36, 151936
  per_layer = _attn(d, 32, 8, 128, qk_norm=True, gate=False) + 3 * d * 12288 + 2 * d
  return 2 * v * d + d + layers * per_layer


def _expected_gemma3_4b():
  d, layers, v = 2560, 34, 262208  # tied head
  per_layer = _attn(d, 8, 4, 256, qk_norm=True, gate=False) + 3 * d * 10240 + 4 * d
  return v * d + d + layers * per_layer


def _expected_hybrid(d, layers, v, e, fe, fs):
  full = layers // 4
  attn = _attn(d, 16, 2, 256, qk_norm=True, gate=True)
  gdn = _gdn(d, 16, 32, 128, 128, 4)
  return 2 * v * d + d + full * attn + (layers - full) * gdn + layers * (_moe(d, e, fe, fs) + 2 * d)


REAL = {
    "llama3.1-8b": (_expected_llama31_8b, 8.03e9),
    "qwen3-8b": (_expected_qwen3_8b, 8.19e9),
    "gemma3-4b": (_expected_gemma3_4b, 3.88e9),
    "qwen3-next-80b-a3b": (lambda: _expected_hybrid(2048, 48, 151936, 512, 512, 512), 80e9),
    "qwen3.5-35b-a3b": (lambda: _expected_hybrid(2048, 40, 248320, 256, 512, 512), 35e9),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_real_config_parameter_counts(name):
  expected_fn, headline = REAL[name]
  count = param_count(load_config(model_name=name))
  assert count == expected_fn()
  assert abs(count - headline) / headline < 0.01
  if name == "llama3.1-8b":
    assert count == 8_030_261_248


@pytest.mark.slow
def test_param_count_allocates_nothing():
  cfg = load_config(model_name="qwen3-next-80b-a3b")
  model = abstract_model(cfg)
  leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


@pytest.mark.parametrize(
    "name", ["llama-tiny", "qwen3-next-tiny", "gpt-oss-tiny", "bamba-tiny", "gemma3-tiny", "qwen3.5-tiny"]
)
def test_abstract_model_has_the_structure_of_a_randomly_initialised_one(name):
  # abstract_model draws no keys (ShapeOnlyRngs); its tree, shapes and dtypes must still be a real build's.
  cfg = load_config(model_name=name)
  abstract = abstract_model(cfg)
  seeded = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(cfg.init_seed)))
  # The node tree (a graphdef would also compare the layers' functools.partial attributes, equal only by identity).
  assert [(path, type(node)) for path, node in nnx.iter_graph(abstract)] == [
      (path, type(node)) for path, node in nnx.iter_graph(seeded)
  ]
  got = {k: (tuple(v.shape), v.dtype) for k, v in get_flat_params(abstract).items()}
  assert got == {k: (tuple(v.shape), v.dtype) for k, v in get_flat_params(seeded).items()}
  state = jax.tree_util.tree_leaves(nnx.state(abstract))
  assert state and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in state)
