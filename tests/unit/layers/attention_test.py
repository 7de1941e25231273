"""Attention: GQA, q/k norm before RoPE, partial RoPE, output gate, sliding window, soft cap, bias, sinks, KV
sharing."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import reference
from support.reference import module_params
from maxtext.layers.attention import Attention, attention_mask, dot_product_attention
from maxtext.layers.rotary import RopeSpec

D, HQ, HKV, DH = 24, 4, 2, 16


def _norm(x, w, zero_centered, eps=1e-6):
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  return y * (1 + w if zero_centered else w)


def _rope(x, pos, rd, theta):
  freqs = theta ** (-np.arange(0, rd, 2) / rd)
  ang = pos[:, None, None] * freqs  # [T, 1, rd/2]
  a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang), x[..., rd:]], -1)


def _ref_attention(x, p, *, pos, rd, theta, scale, window, cap, zero_centered, kv=None):
  """Float64 attention over one sequence x [T, D], vectorised with an explicit mask."""
  x = x.astype(np.float64)

  def proj(n):
    return np.einsum("td,dhk->thk", x, p[n + ".kernel"]) + p.get(n + ".bias", 0.0)

  q = proj("q")
  if "q_norm.scale" in p:
    q = _norm(q, p["q_norm.scale"], zero_centered)
  q = _rope(q, pos, rd, theta)
  if kv is None:
    k = proj("k")
    if "k_norm.scale" in p:
      k = _norm(k, p["k_norm.scale"], zero_centered)
    kv = (_rope(k, pos, rd, theta), proj("v"))
  k, v = kv
  k, v = np.repeat(k, HQ // HKV, axis=1), np.repeat(v, HQ // HKV, axis=1)  # query head h -> kv head h // group
  logits = np.einsum("thd,shd->hts", q, k) * scale
  if cap:
    logits = cap * np.tanh(logits / cap)
  i, j = np.arange(len(x))[:, None], np.arange(len(x))[None, :]
  mask = (j <= i) & ((j > i - window) if window else True)
  logits = np.where(mask, logits, -np.inf)
  if "sinks" in p:  # one more softmax column per head, weighting no value
    sinks = np.broadcast_to(p["sinks"][:, None, None], logits.shape[:2] + (1,))
    probs = np.exp(np.concatenate([logits, sinks], -1) - np.max(np.concatenate([logits, sinks], -1), -1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
  else:
    probs = np.exp(logits - np.max(logits, axis=-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("hts,shd->thd", probs, v)
  if "gate.kernel" in p:
    out = out / (1 + np.exp(-np.einsum("td,dhk->thk", x, p["gate.kernel"])))
  return np.einsum("thk,hkd->td", out, p["o.kernel"]) + p.get("o.bias", 0.0)


def _make(rngs_seed=0, *, rd=DH, theta=10000.0, window=0, cap=0.0, bias=False, qk_norm=False, zc=False, gate=False,
          shared=False, scale=DH**-0.5, sinks=False):  # fmt: skip
  layer = Attention(
      emb_dim=D,
      num_query_heads=HQ,
      num_kv_heads=HKV,
      head_dim=DH,
      attention_scale=scale,
      rope=RopeSpec(rd, theta),
      sliding_window=window,
      soft_cap=cap,
      use_bias=bias,
      use_qk_norm=qk_norm,
      zero_centered_norm=zc,
      use_output_gate=gate,
      is_kv_shared=shared,
      use_sinks=sinks,
      rngs=nnx.Rngs(rngs_seed),
  )
  rng = np.random.default_rng(rngs_seed + 100)
  for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    if path[-1] in ("bias", "scale", "sinks"):  # non-trivial norms, biases and sinks
      var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape) * 0.5, jnp.float32))
  return layer


CASES = {
    "plain_gqa": {},
    "sliding_window_4": {"window": 4},
    "window_1_self_only": {"window": 1},
    "soft_cap": {"cap": 2.0},
    "bias": {"bias": True},
    "qk_norm_plain": {"qk_norm": True},
    "qk_norm_zero_centred_gate_partial_rope": {"qk_norm": True, "zc": True, "gate": True, "rd": 4, "theta": 1e7},
    "gemma_scale": {"qk_norm": True, "zc": True, "scale": 24**-0.5, "window": 3},
    "gpt_oss_sinks_bias_window_3": {"sinks": True, "bias": True, "window": 3},
    "sinks_full": {"sinks": True},
}


@pytest.mark.parametrize("case", CASES)
def test_attention_matches_float64_reference(case):
  kw = CASES[case]
  layer = _make(**kw)
  p = {k: v.astype(np.float64) for k, v in module_params(layer).items()}
  x = np.random.default_rng(1).normal(size=(2, 13, D)).astype(np.float32)
  pos = np.stack([np.arange(13), np.arange(3, 16)])
  out, (k, v) = layer(jnp.asarray(x), jnp.asarray(pos))
  assert out.shape == (2, 13, D) and k.shape == (2, 13, HKV, DH) and v.shape == (2, 13, HKV, DH)
  ref_kw = {
      "rd": kw.get("rd", DH),
      "theta": kw.get("theta", 10000.0),
      "scale": kw.get("scale", DH**-0.5),
      "window": kw.get("window", 0),
      "cap": kw.get("cap", 0.0),
      "zero_centered": kw.get("zc", False),
  }
  for b in range(2):
    ref = _ref_attention(x[b], p, pos=pos[b], **ref_kw)
    np.testing.assert_allclose(np.asarray(out[b]), ref, atol=2e-5)
  # The shared test reference agrees with this one.
  shared_ref, _ = reference.attention(
      x[1],
      p,
      "",
      positions=pos[1],
      freqs=RopeSpec(ref_kw["rd"], ref_kw["theta"]).inv_freq().astype(np.float64),
      scale=ref_kw["scale"],
      window=ref_kw["window"],
      soft_cap=ref_kw["cap"],
      zero_centered=ref_kw["zero_centered"],
  )
  np.testing.assert_allclose(np.asarray(out[1]), shared_ref, atol=2e-5)


def test_parameter_names_and_shapes():
  layer = _make(bias=True, qk_norm=True, gate=True)
  shapes = {k: v.shape for k, v in module_params(layer).items()}
  assert shapes == {
      "q.kernel": (D, HQ, DH),
      "q.bias": (HQ, DH),
      "gate.kernel": (D, HQ, DH),
      "k.kernel": (D, HKV, DH),
      "k.bias": (HKV, DH),
      "v.kernel": (D, HKV, DH),
      "v.bias": (HKV, DH),
      "o.kernel": (HQ, DH, D),
      "o.bias": (D,),
      "q_norm.scale": (DH,),
      "k_norm.scale": (DH,),
  }


def test_attention_mask_sliding_window_keeps_i_minus_w_exclusive():
  idx = jnp.arange(6)
  mask = np.asarray(attention_mask(idx, idx, sliding_window=3))
  for i in range(6):
    for j in range(6):
      assert mask[i, j] == (i - 3 < j <= i)
  np.testing.assert_array_equal(np.asarray(attention_mask(idx, idx)), np.tril(np.ones((6, 6), bool)))


@pytest.mark.slow
def test_sliding_window_changes_output_only_beyond_the_window():
  full, window = _make(), _make(window=4)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 10, D)), jnp.float32)
  pos = jnp.arange(10)[None]
  a, b = full(x, pos)[0], window(x, pos)[0]
  np.testing.assert_allclose(np.asarray(a[:, :4]), np.asarray(b[:, :4]), atol=1e-6)
  assert np.all(np.abs(np.asarray(a[0, 4:] - b[0, 4:])).max(-1) > 1e-4)


@pytest.mark.slow
def test_kv_shared_layer_has_no_kv_params_and_uses_the_given_kv():
  source, shared = _make(0, qk_norm=True, zc=True), _make(1, qk_norm=True, zc=True, shared=True)
  names = set(module_params(shared))
  assert names == {"q.kernel", "o.kernel", "q_norm.scale"}
  x = np.random.default_rng(3).normal(size=(1, 9, D)).astype(np.float32)
  pos = jnp.arange(9)[None]
  _, kv = source(jnp.asarray(x), pos)
  out, kv_used = shared(jnp.asarray(x), pos, shared_kv=kv)
  assert kv_used[0] is kv[0] and kv_used[1] is kv[1]
  p = {k: v.astype(np.float64) for k, v in module_params(shared).items()}
  kv64 = (np.asarray(kv[0][0], np.float64), np.asarray(kv[1][0], np.float64))
  ref = _ref_attention(x[0], p, pos=np.arange(9), rd=DH, theta=10000.0, scale=DH**-0.5, window=0, cap=0.0,
                       zero_centered=True, kv=kv64)  # fmt: skip
  np.testing.assert_allclose(np.asarray(out[0]), ref, atol=2e-5)
  out2, _ = shared(jnp.asarray(x), pos, shared_kv=(kv[0] * 1.5, kv[1]))
  assert float(jnp.abs(out2 - out).max()) > 1e-3


def test_kv_sharing_errors():
  shared, own = _make(shared=True), _make()
  x, pos = jnp.ones((1, 3, D)), jnp.arange(3)[None]
  with pytest.raises(ValueError, match="KV-shared attention layer needs shared_kv from its source layer, got None"):
    shared(x, pos)
  with pytest.raises(ValueError, match="it has no k/v projections"):
    shared.key_value(x, pos)
  kv = own.key_value(x, pos)
  with pytest.raises(ValueError, match="computes its own K/V but shared_kv was given"):
    own(x, pos, shared_kv=kv)


@pytest.mark.slow
def test_dot_product_attention_bfloat16_stays_close_to_float32():
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 5, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)])
  mask = attention_mask(jnp.arange(5), jnp.arange(5))
  ref = dot_product_attention(q, k, v, mask, scale=0.3)
  out = dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask, scale=0.3)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=5e-2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_query_heads": 3}, r"num_query_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"),
        ({"rope": RopeSpec(32, 1.0)}, "rotary_dim 32 must not exceed head_dim 16"),
        ({"sliding_window": -1}, "sliding_window must be >= 0, got -1"),
    ],
)
def test_attention_validation(kwargs, match):
  args = {"emb_dim": D, "num_query_heads": HQ, "num_kv_heads": HKV, "head_dim": DH, "attention_scale": 1.0,
          "rope": RopeSpec(DH, 1e4)}  # fmt: skip
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    Attention(**args, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="query heads 3 must be a multiple of kv heads 2"):
    dot_product_attention(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 2, 4)), True, scale=1.0)
