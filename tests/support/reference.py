"""Float64 NumPy reference of every layer and of the whole decoder, for tests.

Written from the published architectures (docs/architecture.md lists the facts used), independently of
`maxtext.layers`: per-token loops, explicit masks, no chunking. Parameters come as a flat `{canonical name: array}`
dict (`maxtext.models.params` names).
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

# Layer kinds this reference implements (a new kind brings its own float64 reference into its tests).
REFERENCE_LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")

Params = Mapping[str, Any]


def f64(x: Any) -> np.ndarray:
  """Any array (NumPy, JAX, bfloat16) as float64 NumPy (exact for every input dtype)."""
  return np.asarray(x).astype(np.float64)


def module_params(module: nnx.Module) -> dict[str, np.ndarray]:
  """`{joined nnx.Param path: float32 NumPy copy}` of a module (e.g. `"q.kernel"` for an attention layer)."""
  return {
      ".".join(str(k) for k in path): np.asarray(var.get_value(), np.float32)
      for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))
  }


def silu(x: np.ndarray) -> np.ndarray:
  """x * sigmoid(x)."""
  return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
  """Logistic function."""
  return 1.0 / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
  """Tanh-approximated GELU."""
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, zero_centered: bool) -> np.ndarray:
  """`x / sqrt(mean(x^2) + eps) * (1 + w if zero_centered else w)` over the last axis."""
  x, w = f64(x), f64(w)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y * (1.0 + w if zero_centered else w)


def yarn_inv_freq(base: np.ndarray, rotary_dim: int, theta: float, factor: float, original_max: int,
                  beta_fast: float, beta_slow: float, truncate: bool) -> np.ndarray:  # fmt: skip
  """YaRN: frequency i keeps its value below the dim making `beta_fast` turns over the original context, is divided
  by the factor above the one making `beta_slow` turns, and blends linearly in between."""

  def dim_of(turns):
    return rotary_dim * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))

  lo, hi = dim_of(beta_fast), dim_of(beta_slow)
  if truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
  hi = hi + 0.001 if lo == hi else hi
  out = np.empty_like(base)
  for i, f in enumerate(base):
    interpolate = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep f, 1: f / factor
    out[i] = (1 - interpolate) * f + interpolate * f / factor
  return out


def yarn_attention_factor(factor: float, given: float = 0.0) -> float:
  """YaRN's multiplier of cos and sin: `given` when set, else `0.1 ln(factor) + 1` (1 for factor <= 1)."""
  if given > 0:
    return given
  return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def inv_freq(rotary_dim: int, theta: float, rope_type: str = "default", factor: float = 1.0, low: float = 1.0,
             high: float = 4.0, original_max: int = 8192, beta_fast: float = 32.0, beta_slow: float = 1.0,
             truncate: bool = True) -> np.ndarray:  # fmt: skip
  """Inverse frequencies `[rotary_dim/2]` with default, linear, llama3 or yarn scaling."""
  base = theta ** -(np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
  if rope_type == "yarn":
    return yarn_inv_freq(base, rotary_dim, theta, factor, original_max, beta_fast, beta_slow, truncate)
  if rope_type == "linear":
    return base / factor
  if rope_type == "llama3":
    out = np.empty_like(base)
    for i, f in enumerate(base):
      wavelen = 2 * math.pi / f
      if wavelen < original_max / high:
        out[i] = f
      elif wavelen > original_max / low:
        out[i] = f / factor
      else:
        smooth = (original_max / wavelen - low) / (high - low)
        out[i] = (1 - smooth) * f / factor + smooth * f
    return out
  return base


def rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, mscale: float = 1.0) -> np.ndarray:
  """Half-split RoPE on the first `2 * len(freqs)` dims of `x [T, H, Dh]` at `positions [T]`, cos and sin times
  `mscale` (YaRN's attention factor)."""
  x = f64(x).copy()
  half = len(freqs)
  for t, p in enumerate(positions):
    for i, f in enumerate(freqs):
      c, s = mscale * math.cos(p * f), mscale * math.sin(p * f)
      a, b = x[t, :, i].copy(), x[t, :, i + half].copy()
      x[t, :, i] = a * c - b * s
      x[t, :, i + half] = b * c + a * s
  return x


def attention(
    x: np.ndarray,
    p: Params,
    prefix: str,
    *,
    positions: np.ndarray,
    freqs: np.ndarray,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    eps: float = 1e-6,
    zero_centered: bool = False,
    shared_kv: tuple[np.ndarray, np.ndarray] | None = None,
    mscale: float = 1.0,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
  """One sequence `x [T, D]` through an attention layer whose params are `p[prefix + "q.kernel"]` etc.

  With `p[prefix + "sinks"]` (`[Hq]`), head h's softmax has one more term `exp(sinks[h])` that weights no value.
  Returns the output `[T, D]` and the (roped) K/V `[T, Hkv, Dh]` used.
  """
  x = f64(x)

  def proj(name):
    y = np.einsum("td,dhk->thk", x, f64(p[f"{prefix}{name}.kernel"]))
    return y + f64(p[f"{prefix}{name}.bias"]) if f"{prefix}{name}.bias" in p else y

  q = proj("q")
  if f"{prefix}q_norm.scale" in p:
    q = rms_norm(q, p[f"{prefix}q_norm.scale"], eps, zero_centered)
  q = rope(q, positions, freqs, mscale)
  if shared_kv is None:
    k = proj("k")
    if f"{prefix}k_norm.scale" in p:
      k = rms_norm(k, p[f"{prefix}k_norm.scale"], eps, zero_centered)
    k, v = rope(k, positions, freqs, mscale), proj("v")
  else:
    k, v = shared_kv
  t, hq, dh = q.shape
  group = hq // k.shape[1]
  out = np.zeros((t, hq, dh))
  for h in range(hq):
    for i in range(t):
      js = [j for j in range(t) if j <= i and (window <= 0 or j > i - window)]
      logits = np.array([q[i, h] @ k[j, h // group] for j in js]) * scale
      if soft_cap > 0:
        logits = soft_cap * np.tanh(logits / soft_cap)
      sink = f64(p[f"{prefix}sinks"])[h] if f"{prefix}sinks" in p else None
      top = logits.max() if sink is None else max(logits.max(), sink)
      w = np.exp(logits - top)
      w /= w.sum() + (0.0 if sink is None else math.exp(sink - top))
      out[i, h] = sum(wj * v[j, h // group] for wj, j in zip(w, js))
  if f"{prefix}gate.kernel" in p:
    out = out * sigmoid(np.einsum("td,dhk->thk", x, f64(p[f"{prefix}gate.kernel"])))
  y = np.einsum("thk,hkd->td", out, f64(p[f"{prefix}o.kernel"]))
  if f"{prefix}o.bias" in p:
    y = y + f64(p[f"{prefix}o.bias"])
  return y, (k, v)


def gated_delta_net(
    x: np.ndarray, p: Params, prefix: str, *, nk: int, nv: int, hk: int, hv: int, eps: float
) -> np.ndarray:
  """One sequence `x [T, D]` through a Gated DeltaNet layer, token by token. Returns `[T, D]`."""
  x = f64(x)
  t = x.shape[0]
  qkv = x @ f64(p[prefix + "qkv.kernel"])  # [T, C]
  z = (x @ f64(p[prefix + "z.kernel"])).reshape(t, nv, hv)
  b = x @ f64(p[prefix + "b.kernel"])
  a = x @ f64(p[prefix + "a.kernel"])
  conv_w = f64(p[prefix + "conv.kernel"])  # [K, C]
  width = conv_w.shape[0]
  conv = np.zeros_like(qkv)
  for i in range(t):
    for j in range(width):
      src = i - (width - 1) + j
      if src >= 0:
        conv[i] += conv_w[j] * qkv[src]
  conv = silu(conv)
  q = conv[:, : nk * hk].reshape(t, nk, hk)
  k = conv[:, nk * hk : 2 * nk * hk].reshape(t, nk, hk)
  v = conv[:, 2 * nk * hk :].reshape(t, nv, hv)
  q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) * hk**-0.5
  k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  g = -np.exp(f64(p[prefix + "A_log"])) * np.log1p(np.exp(a + f64(p[prefix + "dt_bias"])))
  beta = sigmoid(b)
  r = nv // nk
  o = np.zeros((t, nv, hv))
  for h in range(nv):
    s = np.zeros((hk, hv))
    for i in range(t):
      kh, qh = k[i, h // r], q[i, h // r]
      s = s * np.exp(g[i, h])
      s = s + np.outer(kh, beta[i, h] * (v[i, h] - kh @ s))
      o[i, h] = qh @ s
  o = rms_norm(o, p[prefix + "norm.scale"], eps, False) * silu(z)
  return o.reshape(t, nv * hv) @ f64(p[prefix + "out.kernel"])


def mamba2(
    x: np.ndarray,
    p: Params,
    prefix: str,
    *,
    nh: int,
    hd: int,
    n: int,
    g: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
  """One sequence `x [T, D]` through a Mamba2 layer, token by token (`dt_limit[1] = 0`: no upper clamp).

  Returns `[T, D]`.
  """
  x = f64(x)
  t = x.shape[0]

  def proj(name, inp):
    y = inp @ f64(p[f"{prefix}{name}.kernel"])
    return y + f64(p[f"{prefix}{name}.bias"]) if f"{prefix}{name}.bias" in p else y

  z, xbc, dt = proj("z", x), proj("xbc", x), proj("dt", x)
  conv_w = f64(p[prefix + "conv.kernel"])  # [K, C]
  width = conv_w.shape[0]
  conv = np.zeros_like(xbc) + (f64(p[prefix + "conv.bias"]) if prefix + "conv.bias" in p else 0.0)
  for i in range(t):
    for j in range(width):
      src = i - (width - 1) + j
      if src >= 0:
        conv[i] += conv_w[j] * xbc[src]
  conv = silu(conv)
  inner = nh * hd
  xs = conv[:, :inner].reshape(t, nh, hd)
  b = conv[:, inner : inner + g * n].reshape(t, g, n)
  c = conv[:, inner + g * n :].reshape(t, g, n)
  delta = np.log1p(np.exp(dt + f64(p[prefix + "dt_bias"])))
  delta = np.maximum(delta, dt_limit[0])
  if dt_limit[1] > 0:
    delta = np.minimum(delta, dt_limit[1])
  a = -np.exp(f64(p[prefix + "A_log"]))
  d = f64(p[prefix + "D"])
  y = np.zeros((t, nh, hd))
  for h in range(nh):
    s = np.zeros((hd, n))
    grp = h // (nh // g)
    for i in range(t):
      s = np.exp(delta[i, h] * a[h]) * s + delta[i, h] * np.outer(xs[i, h], b[i, grp])
      y[i, h] = s @ c[i, grp] + d[h] * xs[i, h]
  gated = (y.reshape(t, inner) * silu(z)).reshape(t, g, inner // g)
  normed = gated / np.sqrt(np.mean(gated * gated, axis=-1, keepdims=True) + eps)
  return proj("out", normed.reshape(t, inner) * f64(p[prefix + "norm.scale"]))


def mlp(x: np.ndarray, p: Params, prefix: str, activation: str) -> np.ndarray:
  """Gated MLP `down(act(gate x) * up x)` with optional biases."""
  x = f64(x)

  def proj(name, inp):
    y = inp @ f64(p[f"{prefix}{name}.kernel"])
    return y + f64(p[f"{prefix}{name}.bias"]) if f"{prefix}{name}.bias" in p else y

  return proj("down", ACTIVATIONS[activation](proj("gate", x)) * proj("up", x))


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
  """gpt-oss: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha g)` with `g = min(gate, limit)`."""
  g = np.minimum(gate, limit)
  return (np.clip(up, -limit, limit) + 1.0) * g * sigmoid(alpha * g)


def gpt_oss_moe(x: np.ndarray, p: Params, prefix: str, *, top_k: int, alpha: float, limit: float) -> np.ndarray:
  """gpt-oss routed experts, token by token: biased router logits, top-k, softmax over the k chosen logits, biased
  experts with the clamped SwiGLU."""
  x = f64(x)
  logits = x @ f64(p[prefix + "router.kernel"]) + f64(p[prefix + "router.bias"])
  wg, wu, wd = f64(p[prefix + "gate"]), f64(p[prefix + "up"]), f64(p[prefix + "down"])
  bg, bu, bd = f64(p[prefix + "gate_bias"]), f64(p[prefix + "up_bias"]), f64(p[prefix + "down_bias"])
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    chosen = np.argsort(-logits[t], kind="stable")[:top_k]
    weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
    weights /= weights.sum()
    for w, e in zip(weights, chosen):
      h = clamped_swiglu(x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e], alpha, limit)
      out[t] += w * (h @ wd[e] + bd[e])
  return out


def moe(x: np.ndarray, p: Params, prefix: str, *, top_k: int, normalize: bool, activation: str) -> np.ndarray:
  """Softmax top-k routed experts plus the sigmoid-gated shared expert, token by token."""
  x = f64(x)
  act = ACTIVATIONS[activation]
  logits = x @ f64(p[prefix + "router.kernel"])
  wg, wu, wd = f64(p[prefix + "gate"]), f64(p[prefix + "up"]), f64(p[prefix + "down"])
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    probs = np.exp(logits[t] - logits[t].max())
    probs /= probs.sum()
    chosen = np.argsort(-probs, kind="stable")[:top_k]
    weights = probs[chosen] / (probs[chosen].sum() if normalize else 1.0)
    for w, e in zip(weights, chosen):
      out[t] += w * ((act(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e])
  if prefix + "shared_gate.kernel" in p:
    out += sigmoid(x @ f64(p[prefix + "shared_gate.kernel"])) * mlp(x, p, prefix + "shared.", activation)
  return out


@dataclasses.dataclass(frozen=True)
class _Block:
  """What a family's decoder block does beyond pre-norm attention and MLP, as the published architecture says.

  Written here, not read from `maxtext.configs.families` or the derived config flags, so that the reference does
  not share a mistake with the code it checks.
  """

  zero_centered: bool = False  # every RMSNorm scales by 1 + w
  embedding_scale: bool = False  # embeddings times sqrt(D)
  sandwich: bool = False  # norms after attention and after the MLP too
  global_rope_on_sliding: bool = False  # sliding layers use the global (scaled) RoPE
  gpt_oss_experts: bool = False  # biased router and experts, clamped SwiGLU, on every layer


# One entry per family this reference implements (a new family adds its entry and, if needed, its functions).
_BLOCKS: dict[str, _Block] = {
    "llama2": _Block(),
    "qwen3": _Block(),
    "gemma3": _Block(zero_centered=True, embedding_scale=True, sandwich=True),
    "qwen3_next": _Block(zero_centered=True),
    "qwen3_5": _Block(zero_centered=True),
    "gpt_oss": _Block(global_rope_on_sliding=True, gpt_oss_experts=True),
}


def model_forward(cfg: Any, p: Params, tokens: np.ndarray) -> np.ndarray:
  """Logits `[T, V]` of one sequence `tokens [T]` (positions 0..T-1), float64.

  Family traits come from this module's own table of `cfg.decoder_block` (not from derived config flags); the
  per-layer kinds, KV-sharing sources and MoE layers come from the config.

  Raises:
    NotImplementedError: a family or a layer kind this reference does not implement.
  """
  if cfg.decoder_block not in _BLOCKS:
    raise NotImplementedError(
        f"decoder_block={cfg.decoder_block!r}: the float64 reference implements {', '.join(_BLOCKS)} only"
    )
  block = _BLOCKS[cfg.decoder_block]
  zc = block.zero_centered
  eps = cfg.normalization_layer_epsilon
  act = cfg.mlp_activations[0]
  t = len(tokens)
  positions = np.arange(t)
  emb = f64(p["embedder.embedding"])
  x = emb[np.asarray(tokens)]
  if block.embedding_scale:
    x = x * math.sqrt(cfg.base_emb_dim)
  dh = cfg.head_dim
  rd = int(dh * cfg.partial_rotary_factor)
  scale = (cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar > 0 else dh) ** -0.5
  kvs = {}
  for i, kind in enumerate(cfg.layer_types):
    if kind not in REFERENCE_LAYER_KINDS:
      raise NotImplementedError(
          f"layer {i} is {kind!r}: the float64 reference implements {', '.join(REFERENCE_LAYER_KINDS)} only"
      )
    pre = f"layers.{i}."
    h = rms_norm(x, p[pre + "input_norm.scale"], eps, zc)
    if kind == "linear_attention":
      h = gated_delta_net(
          h,
          p,
          pre + "gdn.",
          nk=cfg.gdn_num_key_heads,
          nv=cfg.gdn_num_value_heads,
          hk=cfg.gdn_key_head_dim,
          hv=cfg.gdn_value_head_dim,
          eps=eps,
      )
    else:
      mscale = 1.0
      if kind == "sliding_attention" and not block.global_rope_on_sliding:
        freqs = inv_freq(rd, cfg.local_rope_max_timescale)
      else:
        freqs = inv_freq(
            rd,
            cfg.rope_max_timescale,
            cfg.rope_type,
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_position_embeddings,
            cfg.rope_beta_fast,
            cfg.rope_beta_slow,
            cfg.rope_truncate,
        )
        if cfg.rope_type == "yarn":
          mscale = yarn_attention_factor(cfg.rope_scaling_factor, cfg.rope_attention_factor)
      src = cfg.kv_shared_source[i]
      h, kvs[i] = attention(
          h,
          p,
          pre + "attn.",
          positions=positions,
          freqs=freqs,
          scale=scale,
          window=cfg.sliding_window_size if kind == "sliding_attention" else 0,
          soft_cap=cfg.attn_logits_soft_cap,
          eps=eps,
          zero_centered=zc,
          shared_kv=kvs[src] if src >= 0 else None,
          mscale=mscale,
      )
    if block.sandwich:
      h = rms_norm(h, p[pre + "post_attn_norm.scale"], eps, zc)
    x = x + h
    h = rms_norm(x, p[pre + "pre_mlp_norm.scale"], eps, zc)
    if block.gpt_oss_experts:
      h = gpt_oss_moe(h, p, pre + "moe.", top_k=cfg.num_experts_per_tok, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    elif cfg.moe_layers[i]:
      h = moe(h, p, pre + "moe.", top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, activation=act)
    else:
      h = mlp(h, p, pre + "mlp.", act)
    if block.sandwich:
      h = rms_norm(h, p[pre + "post_mlp_norm.scale"], eps, zc)
    x = x + h
  x = rms_norm(x, p["final_norm.scale"], eps, zc)
  logits = x @ (emb.T if cfg.logits_via_embedding else f64(p["lm_head.kernel"]))
  if cfg.final_logits_soft_cap > 0:
    logits = cfg.final_logits_soft_cap * np.tanh(logits / cfg.final_logits_soft_cap)
  return logits
