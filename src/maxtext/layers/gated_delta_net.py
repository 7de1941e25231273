"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): causal conv, gated delta rule, gated RMSNorm.

The delta rule has two forms that agree: a chunked full-sequence form (UT transform, triangular solve per chunk)
and a per-token recurrent form. Both run in float32 and take an optional initial state, so prefill/decode and a
paged kernel can reuse the projection, conv, gate and output code around them. `GatedDeltaNet` is the mixer of
the `linear_attention` layer kind; its paged path is one call of the kernel backend's `gdn_attention`.
"""

import math
from collections.abc import Container
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from maxtext.configs import families
from maxtext.configs.families.family import GDN_GROUPED
from maxtext.configs.layer_kinds import LINEAR_ATTENTION, RECURRENT_CACHE
from maxtext.kernels.attention_metadata import AttentionMetadata, recurrent_state_indices
from maxtext.kernels.backend import KernelBackend
from maxtext.kv_cache.cache_spec import RECURRENT_STATE_DTYPE, RecurrentSpec
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.initializers import computed, constant, draw_key, fan_in_uniform, uniform
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.mixer import KV, Mixer, register_mixer
from maxtext.layers.normalizations import RMSNorm, gated_rms_norm
from maxtext.layers.tensor_sources import Reader, Source, cast, depthwise_conv, linear, same

L2_NORM_EPS = 1e-6


def causal_conv1d(x: jax.Array, kernel: jax.Array, state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv: `y_t = sum_k kernel[k] * x_{t-K+1+k}` (kernel[K-1] multiplies x_t), in float32.

  Args:
    x: `[B, T, C]`.
    kernel: `[K, C]`.
    state: `[B, K-1, C]` the K-1 inputs before x (zeros when None).

  Returns:
    y `[B, T, C]` float32 and the new state `[B, K-1, C]` (last K-1 inputs, dtype of x).
  """
  b, t, c = x.shape
  width = kernel.shape[0]
  if state is None:
    state = jnp.zeros((b, width - 1, c), x.dtype)
  xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, T+K-1, C]
  xp32 = xp.astype(jnp.float32)
  k32 = kernel.astype(jnp.float32)
  y = sum(xp32[:, i : i + t] * k32[i] for i in range(width))
  return y, xp[:, t:]


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS) -> jax.Array:
  """`x * rsqrt(sum(x^2) + eps)` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_gates(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Log-decay `g = -exp(A_log) * softplus(a + dt_bias)` and write strength `beta = sigmoid(b)`, float32.

  Args:
    a: `[..., nv]`.
    b: `[..., nv]`.
    a_log: `[nv]`.
    dt_bias: `[nv]`.

  Returns:
    g `[..., nv]` (<= 0) and beta `[..., nv]`.
  """
  f32 = jnp.float32
  g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
  return g, jax.nn.sigmoid(b.astype(f32))


def _zero_state(q: jax.Array, v: jax.Array) -> jax.Array:
  return jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)


def delta_rule_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token gated delta rule: `S = e^g S; S += k (beta (v - k^T S))^T; o = q^T S`.

  Args:
    q: `[B, T, H, dk]` (normalised and scaled).
    k: `[B, T, H, dk]` (normalised).
    v: `[B, T, H, dv]`.
    g: `[B, T, H]` log-decay.
    beta: `[B, T, H]`.
    initial_state: `[B, H, dk, dv]` or None (zeros).

  Returns:
    o `[B, T, H, dv]` and the final state `[B, H, dk, dv]`, both float32.
  """
  state = _zero_state(q, v) if initial_state is None else initial_state.astype(jnp.float32)
  xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]

  def step(s, inputs):
    q_t, k_t, v_t, g_t, b_t = inputs
    s = s * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s)) * b_t[..., None]
    s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

  state, o = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(o, 0, 1), state


def delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Chunked gated delta rule (same result as `delta_rule_recurrent`), float32.

  Within a chunk with cumulative log-decay G, the pending writes u solve the unit lower-triangular system
  `(I + L) u = beta v - (beta k e^G) S0`, `L_ij = beta_i (k_i . k_j) e^(G_i - G_j)` for j < i; outputs are
  `e^G_i q_i^T S0 + sum_{j<=i} e^(G_i - G_j) (q_i . k_j) u_j` and the state carried to the next chunk is
  `e^G_C S0 + sum_j e^(G_C - G_j) k_j u_j^T`. T is zero-padded to a multiple of the chunk (padding has k = 0,
  beta = 0, g = 0, so it leaves the state unchanged).

  Args: as `delta_rule_recurrent`, plus `chunk_size` (tokens per chunk).

  Returns:
    o `[B, T, H, dv]` and the final state `[B, H, dk, dv]`.
  """
  if chunk_size <= 0:
    raise ValueError(f"gdn chunk_size must be positive, got {chunk_size}")
  f32 = jnp.float32
  bsz, t, h, _ = q.shape
  dv = v.shape[-1]
  state = _zero_state(q, v) if initial_state is None else initial_state.astype(f32)
  c = min(chunk_size, t)
  n = math.ceil(t / c)
  pad = n * c - t

  def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
    a = jnp.pad(a.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    a = a.reshape(bsz, n, c, h, *a.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(a, 3, 2), 1, 0)

  qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
  gc = jnp.cumsum(gc, axis=-1)  # [N, B, H, C]
  idx = jnp.arange(c)
  incl = idx[:, None] >= idx[None, :]
  decay = jnp.exp(jnp.where(incl, gc[..., :, None] - gc[..., None, :], -jnp.inf))  # [N, B, H, C, C]
  kb = kc * bc[..., None]
  lower = jnp.where(idx[:, None] > idx[None, :], jnp.einsum("...id,...jd->...ij", kb, kc) * decay, 0.0)
  system = lower + jnp.eye(c, dtype=f32)
  rhs = jnp.concatenate([vc * bc[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
  sol = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
  u, w = sol[..., :dv], sol[..., dv:]  # [N, B, H, C, dv], [N, B, H, C, dk]
  qk = jnp.einsum("...id,...jd->...ij", qc, kc) * decay
  q_decayed = qc * jnp.exp(gc)[..., None]
  k_to_end = kc * jnp.exp(gc[..., -1:] - gc)[..., None]
  end_decay = jnp.exp(gc[..., -1])[..., None, None]

  def step(s, inputs):
    u_n, w_n, qk_n, qd_n, ke_n, ed_n = inputs
    v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s)
    o_n = jnp.einsum("bhck,bhkv->bhcv", qd_n, s) + jnp.einsum("bhij,bhjv->bhiv", qk_n, v_new)
    s = s * ed_n + jnp.einsum("bhck,bhcv->bhkv", ke_n, v_new)
    return s, o_n

  state, o = jax.lax.scan(step, state, (u, w, qk, q_decayed, k_to_end, end_decay))
  o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, dv]
  o = jnp.moveaxis(o, 2, 3).reshape(bsz, n * c, h, dv)[:, :t]
  return o, state


def grouped_qkvz(tensor: str, nk: int, nv: int, hk: int, hv: int, hidden: int) -> Source:
  """Qwen3-Next's in_proj_qkvz, rows grouped per key head g (`[q_g hk | k_g hk | v_g r*hv | z_g r*hv]`), -> the
  flat layout qkv `[D, C]` (`[q nk*hk | k nk*hk | v nv*hv]`, part 0) and z `[D, nv*hv]` (part 1)."""
  r = nv // nk

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(nk, 2 * hk + 2 * r * hv, hidden)
    q, k, v, zz = w[:, :hk], w[:, hk : 2 * hk], w[:, 2 * hk : 2 * hk + r * hv], w[:, 2 * hk + r * hv :]
    flat = np.concatenate([q.reshape(nk * hk, hidden), k.reshape(nk * hk, hidden), v.reshape(nv * hv, hidden)])
    return cast(flat.T, dt), cast(zz.reshape(nv * hv, hidden).T, dt)

  conv_dim = 2 * nk * hk + nv * hv
  return Source((tensor,), ((2 * nk * hk + 2 * nv * hv, hidden),), ((hidden, conv_dim), (hidden, nv * hv)), convert)


def grouped_ba(tensor: str, nk: int, nv: int, hidden: int) -> Source:
  """Qwen3-Next's in_proj_ba, rows per key head `[b_g r | a_g r]`, -> b (part 0), a (part 1) `[D, nv]`."""
  r = nv // nk

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(nk, 2 * r, hidden)
    return cast(w[:, :r].reshape(nv, hidden).T, dt), cast(w[:, r:].reshape(nv, hidden).T, dt)

  return Source((tensor,), ((2 * nv, hidden),), ((hidden, nv), (hidden, nv)), convert)


@register_mixer
class GatedDeltaNet(Mixer):
  """Gated DeltaNet mixer with parameters `qkv`, `z`, `b`, `a`, `conv`, `A_log`, `dt_bias`, `norm`, `out`.

  Channel order of `qkv` and `conv` is flat `[q nk*hk | k nk*hk | v nv*hv]`; value head `g*r + j` (r = nv/nk)
  reads key head `g`. Its cache is a `(conv [M, K-1, C], recurrent [M, nv, hk, hv] fp32)` state slot pair.
  """

  layer_types = (LINEAR_ATTENTION,)
  cache_kind = RECURRENT_CACHE
  param_name = "gdn"

  def __init__(
      self,
      *,
      emb_dim: int,
      num_key_heads: int,
      num_value_heads: int,
      key_head_dim: int,
      value_head_dim: int,
      conv_kernel_dim: int,
      chunk_size: int = 64,
      norm_eps: float = 1e-6,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      mamba_block_size: int | None = None,
      rngs: nnx.Rngs,
  ):
    if min(num_key_heads, num_value_heads, key_head_dim, value_head_dim) <= 0 or num_value_heads % num_key_heads:
      raise ValueError(
          f"gdn value heads ({num_value_heads}) must be a positive multiple of key heads ({num_key_heads}), "
          f"head dims positive (got {key_head_dim}, {value_head_dim})"
      )
    if conv_kernel_dim < 1 or chunk_size < 1:
      raise ValueError(f"gdn conv_kernel_dim and chunk_size must be >= 1, got {conv_kernel_dim}, {chunk_size}")
    self.nk, self.nv, self.hk, self.hv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    self.conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
    self.chunk_size = int(chunk_size)
    self.mamba_block_size = mamba_block_size  # tokens per state block under prefix caching (align scheme)
    self.dtype = jnp.dtype(dtype)
    kw = {"dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.qkv = DenseGeneral(emb_dim, self.conv_dim, **kw)
    self.z = DenseGeneral(emb_dim, num_value_heads * value_head_dim, **kw)
    self.b = DenseGeneral(emb_dim, num_value_heads, **kw)
    self.a = DenseGeneral(emb_dim, num_value_heads, **kw)
    self.conv = _Conv(conv_kernel_dim, self.conv_dim, weight_dtype=weight_dtype, rngs=rngs)

    def log_a():
      a = uniform(draw_key(rngs), (num_value_heads,), jnp.float32, std=7.5 / 3**0.5, mean=8.5)  # U(1, 16)
      return jnp.log(a).astype(weight_dtype)

    self.A_log = nnx.Param(computed(rngs, (num_value_heads,), weight_dtype, log_a))  # pylint: disable=invalid-name
    self.dt_bias = nnx.Param(constant(rngs, (num_value_heads,), weight_dtype, 1.0))
    self.norm = RMSNorm(value_head_dim, eps=norm_eps, zero_centered=False, weight_dtype=weight_dtype, rngs=rngs)
    self.out = DenseGeneral(num_value_heads * value_head_dim, emb_dim, **kw)

  @classmethod
  def from_config(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, *, rngs: nnx.Rngs) -> "GatedDeltaNet":
    """The Gated DeltaNet of a linear_attention layer, from the `gdn_*` keys."""
    del layer_index  # Every linear_attention layer has the same shape.
    return cls(
        emb_dim=cfg.base_emb_dim,
        num_key_heads=cfg.gdn_num_key_heads,
        num_value_heads=cfg.gdn_num_value_heads,
        key_head_dim=cfg.gdn_key_head_dim,
        value_head_dim=cfg.gdn_value_head_dim,
        conv_kernel_dim=cfg.gdn_conv_kernel_dim,
        chunk_size=cfg.gdn_chunk_size,
        norm_eps=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        mamba_block_size=cfg.state_block_size,
        rngs=rngs,
    )

  @classmethod
  def cache_spec(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int) -> RecurrentSpec:
    """A state slot pair: conv `(K-1, conv_dim)` in the compute dtype and recurrent `(nv, hk, hv)` in fp32."""
    return RecurrentSpec(
        layer_type=cfg.layer_types[layer_index],
        state_names=("conv", "recurrent"),
        state_shapes=(
            (cfg.gdn_conv_kernel_dim - 1, cfg.gdn_conv_dim),
            (cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim),
        ),
        state_dtypes=(cfg.dtype, RECURRENT_STATE_DTYPE),
    )

  @classmethod
  def declare(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: Container[str] = ()
  ) -> list[ParamDecl]:
    """The parameters of a linear_attention layer, filled from Hugging Face's `linear_attn.*`: the input
    projections as the family's layout stores them (Qwen3.5's `in_proj_qkv` / `_z` / `_b` / `_a`, or Qwen3-Next's
    `in_proj_qkvz` / `in_proj_ba` grouped per key head), conv1d `[C, 1, K]` -> `[K, C]`, `A_log`, `dt_bias`,
    the output norm and `out_proj`."""
    del layer_index, stored  # every linear_attention layer has the same shape and layout
    p, d = "linear_attn.", cfg.base_emb_dim
    nk, nv, hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    conv_dim = cfg.gdn_conv_dim
    if families.get_family(cfg.decoder_block).tensors.gdn_projections == GDN_GROUPED:
      qkvz, ba = grouped_qkvz(p + "in_proj_qkvz.weight", nk, nv, hk, hv, d), grouped_ba(
          p + "in_proj_ba.weight", nk, nv, d
      )
      inputs = {"qkv": (qkvz, 0), "z": (qkvz, 1), "b": (ba, 0), "a": (ba, 1)}
    else:
      inputs = {
          "qkv": (linear(p + "in_proj_qkv.weight", conv_dim, d), 0),
          "z": (linear(p + "in_proj_z.weight", nv * hv, d), 0),
          "b": (linear(p + "in_proj_b.weight", nv, d), 0),
          "a": (linear(p + "in_proj_a.weight", nv, d), 0),
      }
    axes = {"qkv": ("embed", "gdn_channels"), "z": ("embed", "gdn_values"), "b": ("embed", "gdn_heads")}
    axes["a"] = axes["b"]
    return [ParamDecl(f"{n}.kernel", axes[n], *inputs[n]) for n in ("qkv", "z", "b", "a")] + [
        ParamDecl(
            "conv.kernel", (None, "gdn_channels"), depthwise_conv(p + "conv1d.weight", conv_dim, cfg.gdn_conv_kernel_dim)
        ),
        ParamDecl("A_log", ("gdn_heads",), same(p + "A_log", (nv,))),
        ParamDecl("dt_bias", ("gdn_heads",), same(p + "dt_bias", (nv,))),
        ParamDecl("norm.scale", (None,), same(p + "norm.weight", (hv,))),
        ParamDecl("out.kernel", ("gdn_values", "embed"), linear(p + "out_proj.weight", d, nv * hv)),
    ]

  def project(
      self, x: jax.Array, backend: KernelBackend | None = None
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Input projections on `backend` (default: the reference backend): `[..., D]` -> qkv `[..., C]`,
    z `[..., nv, hv]`, b `[..., nv]`, a `[..., nv]`."""
    qkv, z, b, a = project(x, (self.qkv, self.z, self.b, self.a), backend)
    return qkv, z.reshape(*z.shape[:-1], self.nv, self.hv), b, a

  def split_qkv(self, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Splits post-conv channels `[..., C]` into raw q `[..., nk, hk]`, k `[..., nk, hk]`, v `[..., nv, hv]`."""
    nkk = self.nk * self.hk
    lead = conv_out.shape[:-1]
    q = conv_out[..., :nkk].reshape(*lead, self.nk, self.hk)
    k = conv_out[..., nkk : 2 * nkk].reshape(*lead, self.nk, self.hk)
    v = conv_out[..., 2 * nkk :].reshape(*lead, self.nv, self.hv)
    return q, k, v

  def split_heads(self, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Post-conv channels to delta-rule inputs.

    Args:
      conv_out: `[..., C]` SiLU(conv(qkv)).

    Returns:
      q `[..., nv, hk]` (l2-normalised, scaled by hk^-0.5, repeated to value heads), k `[..., nv, hk]`
      (l2-normalised, repeated), v `[..., nv, hv]`; q and k float32.
    """
    q, k, v = self.split_qkv(conv_out)
    r = self.nv // self.nk
    q = jnp.repeat(l2_normalize(q) * (self.hk**-0.5), r, axis=-2)
    k = jnp.repeat(l2_normalize(k), r, axis=-2)
    return q, k, v

  def gates(self, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(g, beta)` `[..., nv]` float32 from the a/b projections."""
    return gdn_gates(a, b, self.A_log[...], self.dt_bias[...])

  def output(self, o: jax.Array, z: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Gated RMSNorm and out projection: o `[..., nv, hv]`, z `[..., nv, hv]` -> `[..., D]`."""
    y = gated_rms_norm(o.astype(self.dtype), z, self.norm.scale[...], eps=self.norm.eps)
    return self.out(y.reshape(*y.shape[:-2], self.nv * self.hv), backend)

  def forward_with_state(
      self,
      x: jax.Array,
      conv_state: jax.Array | None = None,
      recurrent_state: jax.Array | None = None,
      *,
      chunked: bool = True,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the mixer over `[B, T, D]` continuing from the given states.

    Args:
      x: `[B, T, D]` normalised hidden states.
      conv_state: `[B, K-1, C]` or None (zeros).
      recurrent_state: `[B, nv, hk, hv]` float32 or None (zeros).
      chunked: use the chunked delta rule (else the per-token recurrence).

    Returns:
      y `[B, T, D]`, new conv state `[B, K-1, C]`, new recurrent state `[B, nv, hk, hv]`.
    """
    qkv, z, b, a = self.project(x)
    conv, conv_state = causal_conv1d(qkv, self.conv.kernel[...], conv_state)
    q, k, v = self.split_heads(jax.nn.silu(conv).astype(self.dtype))
    g, beta = self.gates(a, b)
    if chunked:
      o, recurrent_state = delta_rule_chunked(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=recurrent_state)
    else:
      o, recurrent_state = delta_rule_recurrent(q, k, v, g, beta, initial_state=recurrent_state)
    return self.output(o, z), conv_state, recurrent_state

  def paged(
      self,
      x: jax.Array,
      positions: jax.Array,
      state: tuple[jax.Array, jax.Array],
      md: AttentionMetadata,
      backend: KernelBackend,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Runner path: a flat ragged batch continuing each request from its state slot, via `backend.gdn_attention`.

    Args:
      x: `[T, D]` normalised hidden states of the flat batch.
      positions: `[T]` (unused: the recurrence carries position).
      state: `(conv_state [M, K-1, C], recurrent_state [M, nv, hk, hv] float32)`, addressed by
        `md.mamba_state_indices` (slot 0 is the null slot), or under prefix caching by the state blocks of
        `md.block_tables` (read and write slots differ; `attention_metadata.recurrent_state_indices`).
      md: the step's metadata.
      backend: the kernel backend.

    Returns:
      output `[T, D]` and the new `(conv_state, recurrent_state)`.

    Raises:
      ValueError: the metadata names no state slots.
    """
    del positions  # The recurrence carries position; the runner passes positions to every layer.
    conv_state, recurrent_state = state
    read, write = recurrent_state_indices(md, self.mamba_block_size, conv_state.shape[0], "a linear_attention layer")
    qkv, z, b, a = self.project(x, backend)
    kernel_size = self.conv.kernel.shape[0]
    weight = jnp.transpose(self.conv.kernel[...])[:, None, :]  # [K, C] -> the runner's [C, 1, K]
    state, out = backend.gdn_attention(
        qkv,
        b,
        a,
        conv_state,
        recurrent_state,
        weight,
        None,
        self.A_log[...],
        self.dt_bias[...],
        write,
        md.query_start_loc,
        md.request_distribution,
        md.seq_lens,
        self.nk,
        self.nv,
        self.hk,
        self.hv,
        kernel_size,
        read,
    )
    return self.output(out.reshape(out.shape[0], self.nv, self.hv), z, backend), state

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, positions: jax.Array | None = None, shared_kv: KV | None = None, *, chunked: bool = True
  ) -> tuple[jax.Array, None]:
    """Full-sequence causal mixer from zero state: `[B, T, D] -> ([B, T, D], None)` (nothing to share).

    Raises:
      ValueError: `shared_kv` was given (Gated DeltaNet layers do not share K/V).
    """
    del positions  # The recurrence carries position.
    if shared_kv is not None:
      raise ValueError("a linear_attention (Gated DeltaNet) layer cannot take shared K/V")
    return self.forward_with_state(x, chunked=chunked)[0], None


class _Conv(nnx.Module):
  """Holds the depthwise conv weight `kernel [K, C]` (HF conv1d.weight [C, 1, K] transposed)."""

  def __init__(self, width: int, channels: int, *, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(fan_in_uniform(draw_key(rngs), (width, channels), weight_dtype, width))
