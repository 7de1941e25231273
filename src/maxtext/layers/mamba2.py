"""Mamba2 (Granite 4.0, Bamba): input projection, causal conv with bias, selective state scan, gated RMSNorm.

Per token, with `delta = clip(softplus(dt + dt_bias), lo, hi)` and `A = -exp(A_log)` per head, each head's
`[hd, N]` state S follows `S = exp(delta A) S + delta x B^T` and outputs `y = S C + D x`; head h reads B/C group
`h // (nh / G)`. The scan has two forms that agree: a chunked full-sequence form (state-space duality: a masked
`C B^T` product inside each chunk, the state carried between chunks) and a per-token recurrent form. Both run in
float32 and take an optional initial state. The output is `out(rmsnorm_G(y * silu(z)) * w)`: the gate multiplies
before the norm (Gated DeltaNet normalises first), and the norm runs over each of the G groups of `nh * hd / G`
channels. `Mamba2` is the mixer of the `mamba` layer kind; its paged path is one call of the kernel backend's
`mamba2_attention`.
"""

import math
from collections.abc import Container

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.configs.layer_kinds import MAMBA, RECURRENT_CACHE
from maxtext.kernels.attention_metadata import AttentionMetadata, recurrent_state_indices
from maxtext.kernels.backend import KernelBackend
from maxtext.kv_cache.cache_spec import RECURRENT_STATE_DTYPE, RecurrentSpec
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.gated_delta_net import causal_conv1d
from maxtext.layers.initializers import ShapeOnlyRngs, computed, constant, draw_key, fan_in_uniform, uniform
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.mixer import KV, Mixer, register_mixer
from maxtext.layers.tensor_sources import depthwise_conv, linear, same, split_rows


def time_step(dt: jax.Array, dt_bias: jax.Array, time_step_limit: tuple[float, float]) -> jax.Array:
  """`delta = clip(softplus(dt + dt_bias), lo, hi)` in fp32 (`hi <= 0`: no upper limit)."""
  lo, hi = time_step_limit
  out = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
  out = jnp.maximum(out, lo) if lo > 0 else out
  return jnp.minimum(out, hi) if hi > 0 else out


def _zero_state(x: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.zeros((x.shape[0], x.shape[2], x.shape[3], b.shape[3]), jnp.float32)


def ssd_recurrent(
    x: jax.Array,
    delta: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token selective scan `S = exp(delta a) S + delta x b^T; y = S c` (no D skip), float32.

  Args:
    x: `[B, T, H, P]` inputs.
    delta: `[B, T, H]` time steps (after softplus and clamping).
    a: `[H]` negative decay rates (`-exp(A_log)`).
    b: `[B, T, H, N]` input matrices (already repeated from groups to heads).
    c: `[B, T, H, N]` output matrices.
    initial_state: `[B, H, P, N]` or None (zeros).

  Returns:
    y `[B, T, H, P]` and the final state `[B, H, P, N]`.
  """
  f32 = jnp.float32
  state = _zero_state(x, b) if initial_state is None else initial_state.astype(f32)
  xs = [jnp.moveaxis(t.astype(f32), 1, 0) for t in (x, delta, b, c)]
  a = a.astype(f32)

  def step(s, inputs):
    x_t, d_t, b_t, c_t = inputs
    s = jnp.exp(d_t * a)[..., None, None] * s + (d_t[..., None] * x_t)[..., :, None] * b_t[..., None, :]
    return s, jnp.einsum("bhpn,bhn->bhp", s, c_t)

  state, y = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(y, 0, 1), state


def ssd_chunked(
    x: jax.Array,
    delta: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    chunk_size: int,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Chunked selective scan (same result as `ssd_recurrent`), float32.

  Within a chunk with cumulative log-decay `G_i = sum_{j<=i} delta_j a`, outputs are
  `y_i = sum_{j<=i} e^(G_i - G_j) (c_i . b_j) delta_j x_j + e^(G_i) S0 c_i` and the state carried to the next chunk
  is `e^(G_C) S0 + sum_j e^(G_C - G_j) delta_j x_j b_j^T`. T is zero-padded to a multiple of the chunk (padding has
  delta = 0, so it neither decays nor writes the state).

  Args: as `ssd_recurrent`, plus `chunk_size` (tokens per chunk).

  Returns:
    y `[B, T, H, P]` and the final state `[B, H, P, N]`.
  """
  if chunk_size <= 0:
    raise ValueError(f"mamba chunk_size must be positive, got {chunk_size}")
  f32 = jnp.float32
  bsz, t, h, p = x.shape
  state = _zero_state(x, b) if initial_state is None else initial_state.astype(f32)
  size = min(chunk_size, t)
  n = math.ceil(t / size)
  pad = n * size - t

  def chunks(v):  # [B, T, H, ...] -> [N, B, H, C, ...]
    v = jnp.pad(v.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
    v = v.reshape(bsz, n, size, h, *v.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(v, 3, 2), 1, 0)

  xdt = chunks(x * delta[..., None])  # [N, B, H, C, P]
  bc, cc = chunks(b), chunks(c)  # [N, B, H, C, N]
  cum = jnp.cumsum(chunks(delta) * a.astype(f32)[None, None, :, None], axis=-1)  # [N, B, H, C]
  idx = jnp.arange(size)
  incl = idx[:, None] >= idx[None, :]
  decay = jnp.exp(jnp.where(incl, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, B, H, C, C]
  y_diag = jnp.einsum("...ij,...jp->...ip", jnp.einsum("...in,...jn->...ij", cc, bc) * decay, xdt)
  c_decayed = cc * jnp.exp(cum)[..., None]
  b_to_end = bc * jnp.exp(cum[..., -1:] - cum)[..., None]
  end_decay = jnp.exp(cum[..., -1])[..., None, None]

  def step(s, inputs):
    y_n, cd_n, be_n, x_n, ed_n = inputs
    y_n = y_n + jnp.einsum("bhcn,bhpn->bhcp", cd_n, s)
    s = s * ed_n + jnp.einsum("bhcp,bhcn->bhpn", x_n, be_n)
    return s, y_n

  state, y = jax.lax.scan(step, state, (y_diag, c_decayed, b_to_end, xdt, end_decay))
  y = jnp.moveaxis(jnp.moveaxis(y, 0, 1), 2, 3).reshape(bsz, n * size, h, p)[:, :t]
  return y, state


def grouped_gated_rms_norm(y: jax.Array, z: jax.Array, scale: jax.Array, *, groups: int, eps: float) -> jax.Array:
  """Mamba2's output norm: `w * rmsnorm(y * silu(z))`, the mean square taken over each of `groups` channel groups.

  Args:
    y: `[..., I]` scan output.
    z: `[..., I]` gate.
    scale: `[I]` weight.
    groups: G (I must be a multiple).
    eps: RMSNorm epsilon.

  Returns:
    `[..., I]` in the dtype of `y`.
  """
  inner = y.shape[-1]
  if inner % groups:
    raise ValueError(f"mamba norm: {inner} channels do not split into {groups} groups")
  gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
  g = gated.reshape(*gated.shape[:-1], groups, inner // groups)
  g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
  return scale.astype(y.dtype) * g.reshape(gated.shape).astype(y.dtype)


@register_mixer
class Mamba2(Mixer):
  """Mamba2 mixer with parameters `z`, `xbc`, `dt` (the in_proj split), `conv`, `A_log`, `D`, `dt_bias`, `norm`, `out`.

  Conv channels are `[x nh*hd | B G*N | C G*N]`. Its cache is a `(conv [M, K-1, C], ssm [M, nh, hd, N] fp32)` state
  slot pair.
  """

  layer_types = (MAMBA,)
  cache_kind = RECURRENT_CACHE
  param_name = "mamba"

  def __init__(
      self,
      *,
      emb_dim: int,
      num_heads: int,
      head_dim: int,
      state_dim: int,
      num_groups: int,
      conv_kernel_dim: int,
      conv_bias: bool = True,
      proj_bias: bool = False,
      chunk_size: int = 64,
      time_step_limit: tuple[float, float] = (0.0, 0.0),
      norm_eps: float = 1e-6,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      mamba_block_size: int | None = None,
      rngs: nnx.Rngs,
  ):
    if min(num_heads, head_dim, state_dim, num_groups) <= 0 or num_heads % num_groups:
      raise ValueError(
          f"mamba heads ({num_heads}) must be a positive multiple of groups ({num_groups}); head_dim ({head_dim})"
          f" and state_dim ({state_dim}) positive"
      )
    if conv_kernel_dim < 2 or chunk_size < 1:
      raise ValueError(f"mamba conv_kernel_dim must be >= 2 and chunk_size >= 1, got {conv_kernel_dim}, {chunk_size}")
    lo, hi = (float(v) for v in time_step_limit)
    if lo < 0 or (0 < hi < lo):
      raise ValueError(f"mamba time_step_limit must be (lo >= 0, hi >= lo or hi = 0 for none), got {time_step_limit}")
    self.nh, self.hd, self.n, self.g = num_heads, head_dim, state_dim, num_groups
    self.inner = num_heads * head_dim
    self.conv_dim = self.inner + 2 * num_groups * state_dim
    self.chunk_size = int(chunk_size)
    self.time_step_limit = (lo, hi)
    self.eps = float(norm_eps)
    self.dtype = jnp.dtype(dtype)
    self.mamba_block_size = mamba_block_size  # tokens per state block under prefix caching (align scheme)
    kw = {"use_bias": proj_bias, "dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.z = DenseGeneral(emb_dim, self.inner, **kw)
    self.xbc = DenseGeneral(emb_dim, self.conv_dim, **kw)
    self.dt = DenseGeneral(emb_dim, num_heads, **kw)
    self.conv = _BiasedConv(conv_kernel_dim, self.conv_dim, use_bias=conv_bias, weight_dtype=weight_dtype, rngs=rngs)
    log_a = computed(
        rngs,
        (num_heads,),
        weight_dtype,
        lambda: jnp.log(jnp.arange(1, num_heads + 1, dtype=jnp.float32)).astype(weight_dtype),
    )
    self.A_log = nnx.Param(log_a)  # pylint: disable=invalid-name  # canonical name
    self.D = nnx.Param(constant(rngs, (num_heads,), weight_dtype, 1.0))  # pylint: disable=invalid-name  # canonical name
    self.dt_bias = nnx.Param(uniform(draw_key(rngs), (num_heads,), weight_dtype, std=0.5, mean=0.0))
    self.norm = _Scale(self.inner, weight_dtype, rngs)
    self.out = DenseGeneral(self.inner, emb_dim, **kw)

  @classmethod
  def from_config(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, *, rngs: nnx.Rngs) -> "Mamba2":
    """The Mamba2 of a mamba layer, from the `mamba_*` keys."""
    del layer_index  # Every mamba layer has the same shape.
    return cls(
        emb_dim=cfg.base_emb_dim,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        state_dim=cfg.mamba_state_dim,
        num_groups=cfg.mamba_num_groups,
        conv_kernel_dim=cfg.mamba_conv_kernel_dim,
        conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias,
        chunk_size=cfg.mamba_chunk_size,
        time_step_limit=(cfg.mamba_time_step_min, cfg.mamba_time_step_max),
        norm_eps=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        mamba_block_size=cfg.state_block_size,
        rngs=rngs,
    )

  @classmethod
  def cache_spec(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int) -> RecurrentSpec:
    """A state slot pair: conv `(K-1, conv_dim)` in the compute dtype and ssm `(nh, hd, N)` in fp32."""
    return RecurrentSpec(
        layer_type=cfg.layer_types[layer_index],
        state_names=("conv", "ssm"),
        state_shapes=(
            (cfg.mamba_conv_kernel_dim - 1, cfg.mamba_conv_dim),
            (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_dim),
        ),
        state_dtypes=(cfg.dtype, RECURRENT_STATE_DTYPE),
    )

  @classmethod
  def declare(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: Container[str] = ()
  ) -> list[ParamDecl]:
    """The parameters of a mamba layer, filled from Hugging Face's `mamba.*`: in_proj `[I + C + nh, D]` split by
    rows into z, xbc and dt (and its bias likewise), conv1d, `A_log`, `D`, `dt_bias`, the norm and `out_proj`.
    They stay replicated over the model axis (the grouped `[x | B | C]` channels have no per-shard layout here);
    only the hidden axis follows `embed`."""
    del layer_index, stored  # every mamba layer has the same shape and layout
    p = "mamba."
    d, nh, inner, conv_dim = cfg.base_emb_dim, cfg.mamba_num_heads, cfg.mamba_inner_dim, cfg.mamba_conv_dim
    names, sizes = ("z", "xbc", "dt"), (inner, conv_dim, nh)
    in_proj = split_rows(p + "in_proj.weight", sizes, d)
    decls = [ParamDecl(f"{n}.kernel", ("embed", None), in_proj, j) for j, n in enumerate(names)]
    decls += [
        ParamDecl("conv.kernel", (None, None), depthwise_conv(p + "conv1d.weight", conv_dim, cfg.mamba_conv_kernel_dim)),
        ParamDecl("A_log", (None,), same(p + "A_log", (nh,))),
        ParamDecl("D", (None,), same(p + "D", (nh,))),
        ParamDecl("dt_bias", (None,), same(p + "dt_bias", (nh,))),
        ParamDecl("norm.scale", (None,), same(p + "norm.weight", (inner,))),
        ParamDecl("out.kernel", (None, "embed"), linear(p + "out_proj.weight", d, inner)),
    ]
    if cfg.mamba_conv_bias:
      decls.append(ParamDecl("conv.bias", (None,), same(p + "conv1d.bias", (conv_dim,))))
    if cfg.mamba_proj_bias:
      in_bias = split_rows(p + "in_proj.bias", sizes, None)
      decls += [ParamDecl(f"{n}.bias", (None,), in_bias, j) for j, n in enumerate(names)]
      decls.append(ParamDecl("out.bias", ("embed",), same(p + "out_proj.bias", (d,))))
    return decls

  def project(self, x: jax.Array, backend: KernelBackend | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The input projection on `backend` (default: the reference backend): `[..., D]` -> z `[..., I]`,
    xBC `[..., C]`, dt `[..., nh]`."""
    z, xbc, dt = project(x, (self.z, self.xbc, self.dt), backend)
    return z, xbc, dt

  def split(self, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Post-conv channels `[..., C]` -> x `[..., nh, hd]`, B and C `[..., nh, N]` (groups repeated to heads)."""
    lead = conv_out.shape[:-1]
    bc = self.g * self.n
    x = conv_out[..., : self.inner].reshape(*lead, self.nh, self.hd)
    b = conv_out[..., self.inner : self.inner + bc].reshape(*lead, self.g, self.n)
    c = conv_out[..., self.inner + bc :].reshape(*lead, self.g, self.n)
    r = self.nh // self.g
    return x, jnp.repeat(b, r, axis=-2), jnp.repeat(c, r, axis=-2)

  def output(self, y: jax.Array, z: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Gated group RMSNorm and out projection: y `[..., I]`, z `[..., I]` -> `[..., D]`."""
    normed = grouped_gated_rms_norm(y.astype(self.dtype), z, self.norm.scale[...], groups=self.g, eps=self.eps)
    return self.out(normed, backend)

  def forward_with_state(
      self,
      x: jax.Array,
      conv_state: jax.Array | None = None,
      ssm_state: jax.Array | None = None,
      *,
      chunked: bool = True,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the mixer over `[B, T, D]` continuing from the given states.

    Args:
      x: `[B, T, D]` normalised hidden states.
      conv_state: `[B, K-1, C]` or None (zeros).
      ssm_state: `[B, nh, hd, N]` float32 or None (zeros).
      chunked: use the chunked scan (else the per-token recurrence).

    Returns:
      y `[B, T, D]`, new conv state `[B, K-1, C]`, new ssm state `[B, nh, hd, N]`.
    """
    z, xbc, dt = self.project(x)
    conv, conv_state = causal_conv1d(xbc, self.conv.kernel[...], conv_state)
    if self.conv.bias is not None:
      conv = conv + self.conv.bias[...].astype(jnp.float32)
    xs, b, c = self.split(jax.nn.silu(conv))
    delta = time_step(dt, self.dt_bias[...], self.time_step_limit)
    a = -jnp.exp(self.A_log[...].astype(jnp.float32))
    if chunked:
      y, ssm_state = ssd_chunked(xs, delta, a, b, c, chunk_size=self.chunk_size, initial_state=ssm_state)
    else:
      y, ssm_state = ssd_recurrent(xs, delta, a, b, c, initial_state=ssm_state)
    y = y + self.D[...].astype(jnp.float32)[:, None] * xs
    return self.output(y.reshape(*y.shape[:-2], self.inner), z), conv_state.astype(xbc.dtype), ssm_state

  def paged(
      self,
      x: jax.Array,
      positions: jax.Array,
      state: tuple[jax.Array, jax.Array],
      md: AttentionMetadata,
      backend: KernelBackend,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Runner path: a flat ragged batch continuing each request from its state slot, via `backend.mamba2_attention`.

    Args:
      x: `[T, D]` normalised hidden states of the flat batch.
      positions: `[T]` (unused: the recurrence carries position).
      state: `(conv_state [M, K-1, C], ssm_state [M, nh, hd, N] float32)`, addressed by `md.mamba_state_indices`
        (slot 0 is the null slot), or under prefix caching by the state blocks of `md.block_tables` (read and
        write slots differ; `attention_metadata.recurrent_state_indices`).
      md: the step's metadata.
      backend: the kernel backend.

    Returns:
      output `[T, D]` and the new `(conv_state, ssm_state)`.

    Raises:
      ValueError: the metadata names no state slots.
    """
    del positions  # The recurrence carries position; the runner passes positions to every layer.
    conv_state, ssm_state = state
    read, write = recurrent_state_indices(md, self.mamba_block_size, conv_state.shape[0], "a mamba layer")
    z, xbc, dt = self.project(x, backend)
    kernel_size = self.conv.kernel.shape[0]
    weight = jnp.transpose(self.conv.kernel[...])[:, None, :]  # [K, C] -> the runner's [C, 1, K]
    bias = None if self.conv.bias is None else self.conv.bias[...]
    state, y = backend.mamba2_attention(
        xbc,
        dt,
        conv_state,
        ssm_state,
        weight,
        bias,
        self.A_log[...],
        self.D[...],
        self.dt_bias[...],
        write,
        md.query_start_loc,
        md.request_distribution,
        md.seq_lens,
        self.nh,
        self.hd,
        self.g,
        self.n,
        kernel_size,
        self.time_step_limit,
        read,
    )
    return self.output(y, z, backend), state

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, positions: jax.Array | None = None, shared_kv: KV | None = None, *, chunked: bool = True
  ) -> tuple[jax.Array, None]:
    """Full-sequence causal mixer from zero state: `[B, T, D] -> ([B, T, D], None)` (nothing to share).

    Raises:
      ValueError: `shared_kv` was given (mamba layers do not share K/V).
    """
    del positions  # The recurrence carries position.
    if shared_kv is not None:
      raise ValueError("a mamba layer cannot take shared K/V")
    return self.forward_with_state(x, chunked=chunked)[0], None


class _BiasedConv(nnx.Module):
  """The depthwise conv: `kernel [K, C]` (HF conv1d.weight [C, 1, K] transposed) and `bias [C]` (or None)."""

  def __init__(self, width: int, channels: int, *, use_bias: bool, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(fan_in_uniform(draw_key(rngs), (width, channels), weight_dtype, width))
    self.bias = nnx.Param(fan_in_uniform(draw_key(rngs), (channels,), weight_dtype, width)) if use_bias else None


class _Scale(nnx.Module):
  """The gated norm's weight `scale [I]` (init 1)."""

  def __init__(self, features: int, weight_dtype: jnp.dtype, rngs: nnx.Rngs | ShapeOnlyRngs):
    self.scale = nnx.Param(constant(rngs, (features,), weight_dtype, 1.0))
