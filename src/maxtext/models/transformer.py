"""Hybrid decoder-only transformer built from `cfg.layer_types` (Llama, Qwen3, Gemma3, Qwen3-Next, Qwen3.5,
Granite 4.0, Bamba)."""

from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.configs import families
from maxtext.configs.model_config import ModelConfig
from maxtext.kernels.attention_metadata import AttentionMetadata
from maxtext.kernels.backend import KernelBackend, default_backend
from maxtext.layers.declarations import ParamDecl, StoredTensors, nest
from maxtext.layers.embeddings import Embed, greedy_token_ids
from maxtext.layers.initializers import ShapeOnlyRngs
from maxtext.layers.linears import DenseGeneral
from maxtext.layers.tensor_sources import linear
from maxtext.layers.normalizations import RMSNorm
from maxtext.layers.mixer import KV
from maxtext.models.decoder_layer import DecoderLayer


class Transformer(nnx.Module):
  """Decoder-only language model.

  Parameters: `embedder.embedding [V, D]`, `layers.{i}.*`, `final_norm.scale [D]` and, unless
  `logits_via_embedding`, `lm_head.kernel [D, V]` (the table in docs/architecture.md). Random init from `rngs`, parameters
  in `cfg.weight_dtype`, compute in `cfg.dtype`.
  """

  def __init__(self, cfg: ModelConfig | ml_collections.FrozenConfigDict, *, rngs: nnx.Rngs):
    # The layers see the typed model config only: a loaded config's run keys are not fields of it.
    self.cfg = cfg = ModelConfig.from_config(cfg)
    self.dtype = jnp.dtype(cfg.dtype)
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    d = cfg.base_emb_dim
    self.embedder = Embed(
        cfg.vocab_size, d, use_scale=cfg.use_embedding_scale, dtype=self.dtype, weight_dtype=weight_dtype, rngs=rngs
    )
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(len(cfg.layer_types))])
    self.final_norm = RMSNorm(
        d,
        eps=cfg.normalization_layer_epsilon,
        zero_centered=cfg.use_zero_centered_norm,
        weight_dtype=weight_dtype,
        rngs=rngs,
    )
    if cfg.logits_via_embedding:
      self.lm_head = None
    else:
      self.lm_head = DenseGeneral(d, cfg.vocab_size, dtype=self.dtype, weight_dtype=weight_dtype, rngs=rngs)
    self.final_logits_soft_cap = float(cfg.final_logits_soft_cap)
    self.embedding_multiplier = float(cfg.embedding_multiplier)
    self.logits_scaling = float(cfg.logits_scaling)

  @classmethod
  def declare(cls, cfg: ModelConfig | ml_collections.FrozenConfigDict, stored: Collection[str] = ()) -> list[ParamDecl]:
    """Every parameter of the model of `cfg` under its canonical name, with its logical axes and the Hugging Face
    tensors that fill it (the layouts that depend on which tensors a checkpoint holds read `stored`, its names)."""
    cfg = ModelConfig.from_config(cfg)
    d, v = cfg.base_emb_dim, cfg.vocab_size
    stored = StoredTensors(stored)
    decls = nest(Embed.declare(v, d, "model.embed_tokens.weight"), "embedder.")
    for i in range(len(cfg.layer_types)):
      hf = f"model.layers.{i}."
      decls += nest(DecoderLayer.declare(cfg, i, stored.under(hf)), f"layers.{i}.", hf)
    decls += nest(RMSNorm.declare(d, families.get_family(cfg.decoder_block).tensors.final_norm), "final_norm.")
    if not cfg.logits_via_embedding:
      decls.append(ParamDecl("lm_head.kernel", ("embed", "vocab"), linear("lm_head.weight", v, d)))
    return decls

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings `[...]` -> `[..., D]` (Gemma3: scaled by sqrt(D) in the weight dtype; Granite: times
    `embedding_multiplier`)."""
    x = self.embedder(tokens)
    return x if self.embedding_multiplier == 1.0 else x * jnp.asarray(self.embedding_multiplier, x.dtype)

  def decode_hidden(self, x: jax.Array, positions: jax.Array | None = None, *, gdn_chunked: bool = True) -> jax.Array:
    """Runs every layer over a full causal sequence and the final norm.

    KV-shared layers take the K/V that their source layer computed in this same pass.

    Args:
      x: `[B, T, D]` input embeddings.
      positions: `[B, T]` RoPE positions (default `arange(T)` for every row).
      gdn_chunked: Gated DeltaNet form: chunked (default) or the per-token recurrence the runner's kernel uses.

    Returns:
      `[B, T, D]` final-normed hidden states.
    """
    if x.ndim != 3:
      raise ValueError(f"decode_hidden expects embeddings [B, T, D], got shape {x.shape}")
    b, t, _ = x.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    elif positions.shape != (b, t):
      raise ValueError(f"positions must have shape {(b, t)} (like tokens), got {positions.shape}")
    sources = set(self.cfg.kv_shared_source) - {-1}
    kv_by_layer: dict[int, KV] = {}
    for i, layer in enumerate(self.layers):
      source = layer.kv_source
      x, kv = layer(x, positions, kv_by_layer[source] if source >= 0 else None, gdn_chunked=gdn_chunked)
      if i in sources:
        kv_by_layer[i] = kv
    return self.final_norm(x)

  def forward_paged(
      self,
      x: jax.Array,
      positions: jax.Array,
      kv_caches: Sequence[Any],
      layer_indices: Sequence[int],
      layer_metadata: Sequence[AttentionMetadata],
      backend: KernelBackend | None = None,
  ) -> tuple[jax.Array, list[Any]]:
    """Runner path: every layer over a flat ragged batch with its own slot and metadata, then the final norm.

    The physical list is threaded through the layers in layer order: layer i reads `kv_caches[layer_indices[i]]`
    as the layers before it left it and puts back what it returns. So layers of different KV-cache groups that
    share one array (each writing its own group's blocks) all keep their writes, and a KV-shared layer, mapped to
    its source's slot, reads the K/V its source wrote in this same step and hands the object back unchanged. This
    is Python indexing only: no XLA operation.

    Args:
      x: `[T, D]` input embeddings of the flat batch.
      positions: `[T]` positions (from the metadata).
      kv_caches: the runner's physical caches (paged KV arrays or `(conv, recurrent)` tuples), in its order.
      layer_indices: the slot of every layer (`hybrid_cache_utils.resolve_layer_kv_cache_indices`).  # [L]
      layer_metadata: one `AttentionMetadata` per layer, in layer order (its KV-cache group's).
      backend: the kernel backend of every runner op (default: the reference backend).

    Returns:
      `[T, D]` final-normed hidden states and the physical caches after the step, in the runner's order.

    Raises:
      ValueError: the lists do not have one entry per layer, or x / positions have the wrong rank.
    """
    n = len(self.layers)
    if len(layer_indices) != n or len(layer_metadata) != n:
      raise ValueError(
          f"forward_paged needs one slot and one metadata per layer ({n} layers); got {len(layer_indices)} slots"
          f" and {len(layer_metadata)} metadata"
      )
    if x.ndim != 2 or positions.shape != x.shape[:1]:
      raise ValueError(f"forward_paged expects x [T, D] and positions [T]; got {x.shape} and {positions.shape}")
    backend = default_backend() if backend is None else backend
    caches = list(kv_caches)
    for i, layer in enumerate(self.layers):
      slot = layer_indices[i]
      x, caches[slot] = layer.paged(x, positions, caches[slot], layer_metadata[i], backend)
    return self.final_norm(x), caches

  def compute_logits(self, hidden: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Output head (tied or untied) on `backend` (default: the reference backend), divided by `logits_scaling`
    (Granite), and the optional final tanh soft cap: `[..., D] -> [..., V]`."""
    if self.lm_head is None:
      logits = self.embedder.attend(hidden, backend)
    else:
      logits = self.lm_head(hidden, backend)
    return self._finish_logits(logits)

  def _finish_logits(self, logits: jax.Array) -> jax.Array:
    """`logits_scaling` and the final soft cap, on the head's raw products."""
    if self.logits_scaling != 1.0:
      logits = logits / jnp.asarray(self.logits_scaling, logits.dtype)
    if self.final_logits_soft_cap > 0:
      cap = self.final_logits_soft_cap
      logits = jnp.tanh(logits / cap) * cap
    return logits

  def greedy_token_ids(self, hidden: jax.Array, backend: KernelBackend | None = None) -> tuple[jax.Array, jax.Array]:
    """The greedy pick of each row, `[R, D]` -> `[R]` int32 token ids, and `[R]` whether its logits are all finite.

    With a coarse copy of a tied head (`Embed.add_coarse_copy`), the pick is the best of the candidates it
    nominates, by their logits from the table (`Embed.candidates`); otherwise the first maximum of every logit.
    """
    if self.lm_head is None and self.embedder.coarse is not None:
      ids, raw, coarse_finite = self.embedder.candidates(hidden, backend)
      logits = self._finish_logits(raw)  # [R, K]
      return greedy_token_ids(logits, ids), coarse_finite & jnp.all(jnp.isfinite(logits), axis=-1)
    logits = self.compute_logits(hidden, backend)
    return greedy_token_ids(logits), jnp.all(jnp.isfinite(logits), axis=-1)

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, tokens: jax.Array, positions: jax.Array | None = None, *, gdn_chunked: bool = True
  ) -> jax.Array:
    """Dense causal forward: the tests' reference for the paged path (the runners call `forward_paged`); every
    layer's mixer must define the optional dense forward (`layers/mixer.py`).

    Args:
      tokens: `[B, T]` int32 ids.
      positions: `[B, T]` or None (`arange(T)`).
      gdn_chunked: Gated DeltaNet form (see `decode_hidden`).

    Returns:
      logits `[B, T, V]` in `cfg.dtype`.
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}")
    return self.compute_logits(self.decode_hidden(self.embed(tokens), positions, gdn_chunked=gdn_chunked))


def abstract_model(cfg: ml_collections.FrozenConfigDict) -> Transformer:
  """The model with `jax.ShapeDtypeStruct` parameters (no memory allocated), built without a trace."""
  return Transformer(cfg, rngs=ShapeOnlyRngs())
