"""Grouped-query attention with the variants of the supported families.

Variants: q/k RMSNorm before RoPE, partial RoPE, per-head sigmoid output gate (Qwen3-Next/3.5), sliding window,
tanh logit soft cap, projection biases, and KV-shared layers that read K/V computed by a source layer.

The module splits into `query`, `key_value`, `attend` (the core op) and `output` so that a paged path can
replace only the core op with a kernel while reusing projections, norms, RoPE and gates.
"""

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers.linears import DenseGeneral
from maxtext.layers.normalizations import RMSNorm
from maxtext.layers.rotary import RopeSpec, apply_rope

logger = logging.getLogger(__name__)


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
) -> jax.Array:
  """Softmax attention in float32 with grouped KV heads (query head h reads KV head h // (Hq / Hkv)).

  Args:
    q: `[B, T, Hq, Dh]`.
    k: `[B, S, Hkv, Dh]`.
    v: `[B, S, Hkv, Dh]`.
    mask: `[B, T, S]` or broadcastable boolean, True = attend. Every query row needs one True entry.
    scale: multiplier of the logits.
    soft_cap: `c * tanh(logits / c)` before masking when > 0.

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
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(q.dtype))
  return out.reshape(b, t, hq, dh)


class Attention(nnx.Module):
  """Attention layer with parameters `q`, `gate`, `k`, `v`, `o`, `q_norm`, `k_norm` (see INTERFACES.md)."""

  def __init__(
      self,
      *,
      emb_dim: int,
      num_query_heads: int,
      num_kv_heads: int,
      head_dim: int,
      attention_scale: float,
      rope: RopeSpec,
      sliding_window: int = 0,
      soft_cap: float = 0.0,
      use_bias: bool = False,
      use_qk_norm: bool = False,
      zero_centered_norm: bool = False,
      norm_eps: float = 1e-6,
      use_output_gate: bool = False,
      is_kv_shared: bool = False,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_query_heads <= 0 or num_kv_heads <= 0 or num_query_heads % num_kv_heads:
      raise ValueError(
          f"num_query_heads ({num_query_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
      )
    if rope.rotary_dim > head_dim:
      raise ValueError(f"rotary_dim {rope.rotary_dim} must not exceed head_dim {head_dim}")
    if sliding_window < 0:
      raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
    self.num_query_heads = num_query_heads
    self.num_kv_heads = num_kv_heads
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
    norm_kw = {"eps": norm_eps, "zero_centered": zero_centered_norm, "weight_dtype": weight_dtype}
    self.q_norm = RMSNorm(head_dim, **norm_kw) if use_qk_norm else None
    self.k_norm = RMSNorm(head_dim, **norm_kw) if use_qk_norm and not is_kv_shared else None

  def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries after q-norm and RoPE: `[..., T, D] -> [..., T, Hq, Dh]`."""
    q = self.q(x)
    if self.q_norm is not None:
      q = self.q_norm(q)
    return apply_rope(q, positions, self.rope)

  def key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys (k-norm, RoPE) and values: `[..., T, D] -> ([..., T, Hkv, Dh], [..., T, Hkv, Dh])`."""
    if self.k is None:
      raise ValueError("this attention layer is KV-shared: it has no k/v projections; pass the source layer's K/V")
    k = self.k(x)
    if self.k_norm is not None:
      k = self.k_norm(k)
    return apply_rope(k, positions, self.rope), self.v(x)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Dense causal core op over a full sequence: `[B, T, Hq, Dh]`, `[B, T, Hkv, Dh]` x2 -> `[B, T, Hq, Dh]`."""
    index = jnp.arange(q.shape[1])
    mask = attention_mask(index, index, sliding_window=self.sliding_window)
    return dot_product_attention(q, k, v, mask, scale=self.scale, soft_cap=self.soft_cap)

  def output(self, attn: jax.Array, x: jax.Array) -> jax.Array:
    """Output gate (sigmoid of `gate(x)`, per head and dim) then `o`: `[..., Hq, Dh]` -> `[..., D]`."""
    if self.gate is not None:
      attn = attn * jax.nn.sigmoid(self.gate(x))
    return self.o(attn)

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self,
      x: jax.Array,
      positions: jax.Array,
      shared_kv: tuple[jax.Array, jax.Array] | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Dense full-sequence causal attention.

    Args:
      x: `[B, T, D]` normalised hidden states.
      positions: `[B, T]` RoPE positions.
      shared_kv: for KV-shared layers, the source layer's `(k, v)` `[B, T, Hkv, Dh]` (required); else None.

    Returns:
      output `[B, T, D]` and the `(k, v)` used (so later layers can share them).
    """
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
