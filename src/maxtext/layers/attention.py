"""Grouped-query attention with the variants of the supported families.

Variants: q/k RMSNorm before RoPE, partial RoPE or none (NoPE), per-head sigmoid output gate (Qwen3-Next/3.5),
sliding window, tanh logit soft cap, projection biases, per-head attention sinks (gpt-oss: a learned logit per head
that joins the softmax but adds no value), and KV-shared layers that read K/V computed by a source layer.

The module splits into `query`, `key_value`, `attend` (the core op) and `output` so that the paged path replaces
only the core op with the kernel backend's ragged paged attention while reusing projections, norms, RoPE and gates.
`Attention` is the mixer of the `full_attention` and `sliding_attention` layer kinds.
"""

from collections.abc import Container

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.configs.errors import ConfigError
from maxtext.configs.model_config import ModelConfig
from maxtext.configs.layer_kinds import ATTENTION_CACHE, FULL_ATTENTION, SLIDING_ATTENTION
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.kernels.backend import KernelBackend
from maxtext.kv_cache.cache_spec import AttentionSpec, kv_cache_dtype
from maxtext.kv_cache.kv_cache_layout import get_padded_num_heads
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.initializers import draw_key, uniform
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.mixer import KV, Mixer, register_mixer
from maxtext.layers.normalizations import RMSNorm
from maxtext.layers.rotary import RopeSpec, apply_rope
from maxtext.layers.tensor_sources import gated_q, head_bias, heads_in, o_proj, refused, same


def rope_spec(cfg: ml_collections.FrozenConfigDict, layer_type: str) -> RopeSpec:
  """RoPE of an attention layer: global layers use `rope_max_timescale` and `rope_type` scaling; sliding layers
  use `local_rope_max_timescale` without scaling, except in families with one RoPE for every layer (gpt-oss)."""
  if layer_type == SLIDING_ATTENTION and not cfg.use_global_rope_on_sliding:
    return RopeSpec(rotary_dim=cfg.rotary_dim, theta=cfg.local_rope_max_timescale)
  return RopeSpec(
      rotary_dim=cfg.rotary_dim,
      theta=cfg.rope_max_timescale,
      rope_type=cfg.rope_type,
      scaling_factor=cfg.rope_scaling_factor,
      low_freq_factor=cfg.rope_low_freq_factor,
      high_freq_factor=cfg.rope_high_freq_factor,
      original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
      beta_fast=cfg.rope_beta_fast,
      beta_slow=cfg.rope_beta_slow,
      truncate=cfg.rope_truncate,
      attention_factor=cfg.rope_attention_factor,
  )


def attention_mask(q_index: jax.Array, kv_index: jax.Array, *, sliding_window: int = 0) -> jax.Array:
  """Causal (optionally sliding-window) mask: key j is visible to query i iff `i - W < j <= i`.

  Args:
    q_index: `[..., T]` query positions in the sequence.
    kv_index: `[..., S]` key positions in the sequence.
    sliding_window: W (self included); 0 = unlimited.

  Returns:
    `[..., T, S]` boolean.
  """
  q = q_index[..., :, None]
  kv = kv_index[..., None, :]
  mask = kv <= q
  if sliding_window > 0:
    mask = mask & (kv > q - sliding_window)
  return mask


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """Softmax attention in float32 with grouped KV heads (query head h reads KV head h // (Hq / Hkv)).

  Args:
    q: `[B, T, Hq, Dh]`.
    k: `[B, S, Hkv, Dh]`.
    v: `[B, S, Hkv, Dh]`.
    mask: `[B, T, S]` or broadcastable boolean, True = attend. Every query row needs one True entry.
    scale: multiplier of the logits.
    soft_cap: `c * tanh(logits / c)` before masking when > 0.
    sinks: `[Hq]` per-head sink logits (unscaled): an extra softmax column that takes probability mass and
      contributes no value; None for none.

  Returns:
    `[B, T, Hq, Dh]` in the dtype of `q`.
  """
  b, t, hq, dh = q.shape
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
  qg = q.reshape(b, t, hkv, hq // hkv, dh)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  if soft_cap > 0:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  mask = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None, None]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  else:
    if sinks.shape != (hq,):
      raise ValueError(f"sinks must have shape (Hq,) = ({hq},), got {sinks.shape}")
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1), logits.shape[:-1] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1].astype(q.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(q.dtype))
  return out.reshape(b, t, hq, dh)


@register_mixer
class Attention(Mixer):
  """Attention mixer with parameters `q`, `gate`, `k`, `v`, `o`, `q_norm`, `k_norm` (kernels `[in..., out...]`) and
  `sinks` `[Hq]`."""

  layer_types = (FULL_ATTENTION, SLIDING_ATTENTION)
  cache_kind = ATTENTION_CACHE
  param_name = "attn"

  def __init__(
      self,
      *,
      emb_dim: int,
      num_query_heads: int,
      num_kv_heads: int,
      head_dim: int,
      attention_scale: float,
      rope: RopeSpec | None,
      sliding_window: int = 0,
      soft_cap: float = 0.0,
      use_bias: bool = False,
      use_qk_norm: bool = False,
      zero_centered_norm: bool = False,
      norm_eps: float = 1e-6,
      use_output_gate: bool = False,
      use_sinks: bool = False,
      is_kv_shared: bool = False,
      cache_kv_heads: int | None = None,
      cache_kv_shards: int = 1,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_query_heads <= 0 or num_kv_heads <= 0 or num_query_heads % num_kv_heads:
      raise ValueError(
          f"num_query_heads ({num_query_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
      )
    if rope is not None and rope.rotary_dim > head_dim:
      raise ValueError(f"rotary_dim {rope.rotary_dim} must not exceed head_dim {head_dim}")
    if sliding_window < 0:
      raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
    cache_kv_heads = num_kv_heads if cache_kv_heads is None else int(cache_kv_heads)
    if cache_kv_heads % num_kv_heads or num_query_heads % cache_kv_heads:
      raise ValueError(
          f"the cache's KV heads ({cache_kv_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) that divides"
          f" num_query_heads ({num_query_heads})"
      )
    self.num_query_heads = num_query_heads
    self.num_kv_heads = num_kv_heads
    if cache_kv_shards < 1 or cache_kv_heads % cache_kv_shards:
      raise ValueError(
          f"the cache's KV heads ({cache_kv_heads}) must split evenly over its {cache_kv_shards} tensor-parallel shards"
      )
    self.cache_kv_heads = cache_kv_heads
    self.cache_kv_shards = int(cache_kv_shards)
    self.head_dim = head_dim
    self.scale = float(attention_scale)
    self.rope = rope
    self.sliding_window = int(sliding_window)
    self.soft_cap = float(soft_cap)
    self.is_kv_shared = bool(is_kv_shared)
    self.dtype = jnp.dtype(dtype)
    kw = {"dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.q = DenseGeneral(emb_dim, (num_query_heads, head_dim), use_bias=use_bias, **kw)
    self.gate = DenseGeneral(emb_dim, (num_query_heads, head_dim), **kw) if use_output_gate else None
    if is_kv_shared:
      self.k = None
      self.v = None
    else:
      self.k = DenseGeneral(emb_dim, (num_kv_heads, head_dim), use_bias=use_bias, **kw)
      self.v = DenseGeneral(emb_dim, (num_kv_heads, head_dim), use_bias=use_bias, **kw)
    self.o = DenseGeneral((num_query_heads, head_dim), emb_dim, use_bias=use_bias, **kw)
    norm_kw = {"eps": norm_eps, "zero_centered": zero_centered_norm, "weight_dtype": weight_dtype, "rngs": rngs}
    self.q_norm = RMSNorm(head_dim, **norm_kw) if use_qk_norm else None
    self.k_norm = RMSNorm(head_dim, **norm_kw) if use_qk_norm and not is_kv_shared else None
    self.sinks = nnx.Param(uniform(draw_key(rngs), (num_query_heads,), weight_dtype, 1.0)) if use_sinks else None

  @classmethod
  def from_config(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, *, rngs: nnx.Rngs) -> "Attention":
    """The attention of layer `layer_index`: its kind picks the window and RoPE; KV-shared layers get no k/v."""
    layer_type = cfg.layer_types[layer_index]
    return cls(
        emb_dim=cfg.base_emb_dim,
        num_query_heads=cfg.base_num_query_heads,
        num_kv_heads=cfg.base_num_kv_heads,
        head_dim=cfg.head_dim,
        attention_scale=cfg.attention_scale,
        rope=rope_spec(cfg, layer_type) if cfg.use_rope else None,
        sliding_window=cfg.sliding_window_size if layer_type == SLIDING_ATTENTION else 0,
        soft_cap=cfg.attn_logits_soft_cap,
        use_bias=cfg.attention_bias,
        use_qk_norm=cfg.use_qk_norm,
        zero_centered_norm=cfg.use_zero_centered_norm,
        norm_eps=cfg.normalization_layer_epsilon,
        use_output_gate=cfg.use_attention_output_gate,
        use_sinks=cfg.use_attention_sinks,
        is_kv_shared=cfg.kv_shared_source[layer_index] >= 0,
        cache_kv_heads=cls.padded_kv_heads(cfg),
        cache_kv_shards=cfg.ici_tensor_parallelism,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        rngs=rngs,
    )

  @classmethod
  def padded_kv_heads(cls, cfg: ModelConfig | ml_collections.FrozenConfigDict) -> int:
    """The KV heads of the runner's cache: the model's, padded to the tensor-parallel size.

    Raises:
      ConfigError: the KV heads can neither be split over nor replicated to `ici_tensor_parallelism` shards, or
        the replicated heads no longer divide the query heads.
    """
    tp, hkv, hq = cfg.ici_tensor_parallelism, cfg.base_num_kv_heads, cfg.base_num_query_heads
    try:
      cache_heads = get_padded_num_heads(hkv, tp)
    except ValueError as e:
      raise ConfigError(f"ici_tensor_parallelism={tp}: base_num_kv_heads={hkv} cannot be sharded: {e}") from None
    if hq % cache_heads:
      raise ConfigError(
          f"ici_tensor_parallelism={tp}: the runner replicates base_num_kv_heads={hkv} to {cache_heads} KV heads,"
          f" which must divide base_num_query_heads={hq}"
      )
    return cache_heads

  @classmethod
  def cache_spec(cls, cfg: ml_collections.FrozenConfigDict, layer_index: int) -> AttentionSpec:
    """A paged KV cache as the runner allocates it (from the run's config: its block size and cache dtype): KV heads
    padded to the tensor-parallel size, each shard of the packed-head axis in the layout of its own heads.

    Raises:
      ConfigError: as `padded_kv_heads`.
    """
    layer_type = cfg.layer_types[layer_index]
    tp = cfg.ici_tensor_parallelism
    return AttentionSpec(
        layer_type=layer_type,
        block_size=cfg.block_size,
        num_kv_heads=cls.padded_kv_heads(cfg),
        head_dim=cfg.head_dim,
        dtype=kv_cache_dtype(cfg),
        sliding_window=cfg.sliding_window_size if layer_type == SLIDING_ATTENTION else None,
        num_shards=tp,
    )

  @classmethod
  def declare(
      cls, cfg: ml_collections.FrozenConfigDict, layer_index: int, stored: Container[str] = ()
  ) -> list[ParamDecl]:
    """The parameters of layer `layer_index`'s attention, filled from Hugging Face's `self_attn.*`: q/k/v_proj
    `[H*Dh, D]` -> `[D, H, Dh]` (a gated q_proj holds `[q_h | gate_h]` rows per head), o_proj `[D, Hq*Dh]` ->
    `[Hq, Dh, D]`, their biases, `sinks`, `q_norm` / `k_norm`. A KV-shared layer has no k/v or k_norm."""
    del stored  # one layout
    p = "self_attn."
    d, hq, hkv, dh = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    shared = cfg.kv_shared_source[layer_index] >= 0
    q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
    if cfg.use_attention_output_gate:
      q = gated_q(p + "q_proj.weight", hq, dh, d)
      decls = [ParamDecl("q.kernel", q_axes, q, 0)]
      if cfg.attention_bias:
        refusal = (
            f"layer {layer_index}: attention_bias with the gated attention of decoder_block={cfg.decoder_block!r}"
            " is not supported"
        )
        decls.append(ParamDecl("gate.kernel", q_axes, refused(refusal)))
      else:
        decls.append(ParamDecl("gate.kernel", q_axes, q, 1))
    else:
      decls = [ParamDecl("q.kernel", q_axes, heads_in(p + "q_proj.weight", hq, dh, d))]
    kv = () if shared else ("k", "v")
    decls += [ParamDecl(f"{n}.kernel", kv_axes, heads_in(p + f"{n}_proj.weight", hkv, dh, d)) for n in kv]
    decls.append(ParamDecl("o.kernel", ("heads", "head_dim", "embed"), o_proj(p + "o_proj.weight", hq, dh, d)))
    if cfg.attention_bias:
      decls.append(ParamDecl("q.bias", ("heads", "head_dim"), head_bias(p + "q_proj.bias", hq, dh)))
      decls += [ParamDecl(f"{n}.bias", ("kv_heads", "head_dim"), head_bias(p + f"{n}_proj.bias", hkv, dh)) for n in kv]
      decls.append(ParamDecl("o.bias", ("embed",), same(p + "o_proj.bias", (d,))))
    if cfg.use_attention_sinks:
      decls.append(ParamDecl("sinks", ("heads",), same(p + "sinks", (hq,))))
    if cfg.use_qk_norm:
      decls.append(ParamDecl("q_norm.scale", ("head_dim",), same(p + "q_norm.weight", (dh,))))
      if not shared:
        decls.append(ParamDecl("k_norm.scale", ("head_dim",), same(p + "k_norm.weight", (dh,))))
    return decls

  def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries after q-norm and RoPE: `[..., T, D] -> [..., T, Hq, Dh]`."""
    return self._finish_query(self.q(x), positions)

  def key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys (k-norm, RoPE) and values: `[..., T, D] -> ([..., T, Hkv, Dh], [..., T, Hkv, Dh])`."""
    if self.k is None:
      raise ValueError("this attention layer is KV-shared: it has no k/v projections; pass the source layer's K/V")
    return self._finish_key(self.k(x), positions), self.v(x)

  def projections(
      self, x: jax.Array, positions: jax.Array, backend: KernelBackend | None = None
  ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """`query`, `key_value` (None, None for a KV-shared layer) and the output gate's logits (None without the gate),
    their projections of `x` taken together on `backend` (`project`; default: the reference backend)."""
    layers = (self.q,) + (() if self.k is None else (self.k, self.v)) + (() if self.gate is None else (self.gate,))
    outputs = list(project(x, layers, backend))
    q = self._finish_query(outputs.pop(0), positions)
    k = v = None
    if self.k is not None:
      k, v = self._finish_key(outputs.pop(0), positions), outputs.pop(0)
    return q, k, v, (outputs.pop(0) if self.gate is not None else None)

  def _finish_query(self, q: jax.Array, positions: jax.Array) -> jax.Array:
    if self.q_norm is not None:
      q = self.q_norm(q)
    return q if self.rope is None else apply_rope(q, positions, self.rope)

  def _finish_key(self, k: jax.Array, positions: jax.Array) -> jax.Array:
    if self.k_norm is not None:
      k = self.k_norm(k)
    return k if self.rope is None else apply_rope(k, positions, self.rope)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Dense causal core op over a full sequence: `[B, T, Hq, Dh]`, `[B, T, Hkv, Dh]` x2 -> `[B, T, Hq, Dh]`."""
    index = jnp.arange(q.shape[1])
    mask = attention_mask(index, index, sliding_window=self.sliding_window)
    return dot_product_attention(q, k, v, mask, scale=self.scale, soft_cap=self.soft_cap, sinks=self.sink_logits())

  def sink_logits(self) -> jax.Array | None:
    """`[Hq]` fp32 sink logits, or None."""
    return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

  def output(
      self,
      attn: jax.Array,
      x: jax.Array,
      gate_logits: jax.Array | None = None,
      backend: KernelBackend | None = None,
  ) -> jax.Array:
    """Output gate (sigmoid of `gate(x)`, per head and dim; `gate_logits` when already computed) then `o`, on
    `backend` (default: the reference backend): `[..., Hq, Dh]` -> `[..., D]`."""
    if self.gate is not None:
      attn = attn * jax.nn.sigmoid(self.gate(x, backend) if gate_logits is None else gate_logits)
    return self.o(attn, backend)

  def paged(
      self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, backend: KernelBackend
  ) -> tuple[jax.Array, jax.Array]:
    """Runner path: a flat ragged batch against this layer's paged cache, through `backend.ragged_paged_attention`.

    The new tokens' K/V are written at their positions, then every query attends causally (and within the
    window) over its request's pages. When the cache holds more KV heads than the layer has (the runner
    replicates KV heads up to the tensor-parallel size), each KV head is repeated into its replicas, which keeps
    query head h reading the copy of KV head h // (Hq / Hkv). A KV-shared layer computes no K/V: it reads the
    cache its source layer has just updated in this same step and writes nothing.

    Args:
      x: `[T, D]` normalised hidden states of the flat batch.
      positions: `[T]` RoPE positions.
      kv_cache: `[N, bs, 2Hkv/pk, pk, Dpad]` paged cache (for a KV-shared layer, the source's updated cache).
      md: this layer's metadata (its KV-cache group's block tables).
      backend: the kernel backend.

    Returns:
      output `[T, D]` and the cache (the same object for KV-shared layers).
    """
    q, k, v, gate_logits = self.projections(x, positions, backend)
    if not self.is_kv_shared:
      if self.cache_kv_heads != self.num_kv_heads:
        replicas = self.cache_kv_heads // self.num_kv_heads
        k, v = jnp.repeat(k, replicas, axis=1), jnp.repeat(v, replicas, axis=1)
    out, new_cache = backend.ragged_paged_attention(
        q,
        k,
        v,
        kv_cache,
        md.seq_lens,
        md.block_tables,
        md.query_start_loc,
        md.request_distribution,
        self.sink_logits(),
        self.scale,
        attention_chunk_size=self.sliding_window or None,
        update_kv_cache=not self.is_kv_shared,
        attn_logits_soft_cap=self.soft_cap or None,
        num_kv_heads=self.cache_kv_heads,
        num_kv_shards=self.cache_kv_shards,
    )
    if self.is_kv_shared:
      new_cache = kv_cache  # Readers hand back the object they were given: exactly one writer per slot.
    return self.output(out.astype(self.dtype), x, gate_logits, backend), new_cache

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self,
      x: jax.Array,
      positions: jax.Array,
      shared_kv: KV | None = None,
      *,
      chunked: bool = True,
  ) -> tuple[jax.Array, KV]:
    """Dense full-sequence causal attention.

    Args:
      x: `[B, T, D]` normalised hidden states.
      positions: `[B, T]` RoPE positions.
      shared_kv: for KV-shared layers, the source layer's `(k, v)` `[B, T, Hkv, Dh]` (required); else None.
      chunked: unused (attention has one full-sequence form).

    Returns:
      output `[B, T, D]` and the `(k, v)` used (so later layers can share them).
    """
    del chunked  # Attention has one full-sequence form.
    if self.is_kv_shared:
      if shared_kv is None:
        raise ValueError("KV-shared attention layer needs shared_kv from its source layer, got None")
      k, v = shared_kv
    else:
      if shared_kv is not None:
        raise ValueError("attention layer computes its own K/V but shared_kv was given")
      k, v = self.key_value(x, positions)
    q = self.query(x, positions)
    return self.output(self.attend(q, k, v), x), (k, v)
