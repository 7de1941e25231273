"""Token embedding with an optional sqrt(D) scale, the tied output head (`attend`), and the greedy pick over a
head's logits (`greedy_token_ids`) or over the candidates a coarse copy of the head nominates (`Embed.candidates`)."""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.kernels.backend import KernelBackend, default_backend
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.initializers import draw_key, fan_in_uniform
from maxtext.layers.tensor_sources import same


def embed_tokens(embedding: jax.Array, tokens: jax.Array, *, scale: float | None, dtype: jnp.dtype) -> jax.Array:
  """Looks up token embeddings.

  Args:
    embedding: `[V, D]` table.
    tokens: `[...]` integer ids.
    scale: multiplier (Gemma: sqrt(D)); it is cast to the table's dtype first and the product is formed in that
      dtype, so in bfloat16 sqrt(3072) becomes 55.5. None = no scaling.
    dtype: compute dtype of the result.

  Returns:
    `[..., D]` in `dtype`.
  """
  x = jnp.take(embedding, tokens, axis=0)
  if scale is not None:
    x = x * jnp.asarray(scale, dtype=jnp.float32).astype(embedding.dtype)
  return x.astype(dtype)


def attend(embedding: jax.Array, x: jax.Array, *, dtype: jnp.dtype, backend: KernelBackend | None = None) -> jax.Array:
  """Tied output head: `x @ embedding^T`, made by `backend` (default: the reference backend).

  Args:
    embedding: `[V, D]` table.
    x: `[..., D]` hidden states.
    dtype: compute dtype.
    backend: the kernel backend.

  Returns:
    `[..., V]` logits in `dtype`.
  """
  backend = default_backend() if backend is None else backend
  return backend.project_transposed(x, embedding, dtype=dtype)


def greedy_token_ids(logits: jax.Array, ids: jax.Array | None = None) -> jax.Array:
  """The first index of each row's maximum (`argmax` for rows of finite values), as int32, traced; with `ids`, the
  smallest id among the entries holding the maximum.

  Two plain reductions (the row maximum, then the smallest index holding it) instead of `argmax`'s paired
  value-index reduction, which XLA's CPU backend runs far slower over a vocabulary-wide row. A row holding NaN
  gets the out-of-range index `V` (its maximum is NaN, which equals nothing); callers reject such rows first.

  Args:
    logits: `[rows, V]` floating point (or `[rows, K]`, the logits of the candidates `ids`).
    ids: `[rows, K]` int32 token ids of the columns (default: the column index); the out-of-range result is then
      the largest id + 1 of nothing, i.e. int32's maximum.

  Returns:
    `[rows]` int32.
  """
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if ids is None:
    vocab = logits.shape[-1]
    return jnp.min(jnp.where(logits == row_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
  return jnp.min(jnp.where(logits == row_max, ids, jnp.iinfo(jnp.int32).max), axis=-1)


class Embed(nnx.Module):
  """Token embedding table `embedding [V, D]` (init variance 1/D).

  A backend may give the tied head a copy of the table in a layout of its own (`add_head_copy`: `head`, tagged
  `head_layout`, e.g. weight-only int8 column panels of `[D, V]`); the lookups still read `embedding`. It may also
  give it a coarse copy (`add_coarse_copy`: `coarse`, e.g. int4 column panels) whose scores only rank the vocabulary:
  a greedy pick then reads the coarse copy whole and, of the table, only the rows of the `coarse_candidates` best
  ranked tokens (`candidates`).
  """

  def __init__(
      self,
      num_embeddings: int,
      features: int,
      *,
      use_scale: bool = False,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    if num_embeddings <= 0 or features <= 0:
      raise ValueError(f"Embed needs positive sizes, got num_embeddings={num_embeddings}, features={features}")
    self.features = int(features)
    self.scale = math.sqrt(features) if use_scale else None
    self.dtype = jnp.dtype(dtype)
    self.embedding = nnx.Param(fan_in_uniform(draw_key(rngs), (num_embeddings, features), weight_dtype, features))
    self.head: nnx.Param | None = nnx.data(None)  # data, not a static attribute: `add_head_copy` may fill it
    self.head_layout: str | None = None
    self.coarse: nnx.Param | None = nnx.data(None)  # `add_coarse_copy` may fill it
    self.coarse_layout: str | None = None
    self.coarse_candidates = 0

  @classmethod
  def declare(cls, num_embeddings: int, features: int, tensor: str) -> list[ParamDecl]:
    """`embedding [V, D]`, stored as Hugging Face's `tensor` (the copies a backend adds are not parameters of a
    checkpoint and not declared)."""
    return [ParamDecl("embedding", ("vocab", "embed"), same(tensor, (num_embeddings, features)))]

  def __call__(self, tokens: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """Embeds `[...]` ids -> `[..., D]`."""
    return embed_tokens(self.embedding[...], tokens, scale=self.scale, dtype=self.dtype)

  def attend(self, x: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Tied head on `backend` (default: the reference backend): `[..., D]` -> `[..., V]`; from the head's copy when
    there is one (`add_head_copy`)."""
    if self.head is None:
      return attend(self.embedding[...], x, dtype=self.dtype, backend=backend)
    backend = default_backend() if backend is None else backend
    vocab = self.embedding.get_value().shape[0]
    return backend.project(
        x, [self.head[...]], [None], num_in_axes=1, out_shapes=[(vocab,)], layouts=[self.head_layout], dtype=self.dtype
    )[0]

  def add_head_copy(self, layout: str, convert: Callable[[Any, jnp.dtype], Any]) -> int:
    """Gives the tied head `convert(table^T as [D, V], compute dtype)` (None: no copy), tagged `layout`, in place; a
    backend's `prepare_params` calls it and its `project` reads the layout. Works on an abstract model too.

    Returns:
      The bytes of the copy (0 without one).
    """
    if self.head is None:
      table = self.embedding.get_value()
      if isinstance(table, jax.ShapeDtypeStruct):
        flat = jax.ShapeDtypeStruct(table.shape[::-1], table.dtype)
      else:
        flat = np.asarray(table).T  # a view; `convert` copies it once
      stored = convert(flat, self.dtype)
      if stored is None:
        return 0
      self.head = nnx.Param(stored)
      self.head_layout = layout
    head = self.head.get_value()
    return math.prod(head.shape) * jnp.dtype(head.dtype).itemsize

  def drop_head_copy(self) -> None:
    """Removes the head's copy (`add_head_copy`): the head reads the table again."""
    self.head = nnx.data(None)
    self.head_layout = None

  def add_coarse_copy(self, layout: str, convert: Callable[[Any, jnp.dtype], Any], candidates: int) -> int:
    """Gives the head a coarse copy, `convert(table^T as [D, V], compute dtype)` (None: no copy), tagged `layout`,
    that nominates `candidates` tokens for a greedy pick (`candidates`), in place; a backend's `prepare_params` calls
    it. Works on an abstract model too.

    Returns:
      The bytes of the copy (0 without one).

    Raises:
      ValueError: `candidates` is not in [1, V].
    """
    vocab = self.embedding.get_value().shape[0]
    if not 1 <= candidates <= vocab:
      raise ValueError(f"a coarse head nominates 1 to {vocab} (the vocabulary) candidates, got {candidates}")
    if self.coarse is None:
      table = self.embedding.get_value()
      if isinstance(table, jax.ShapeDtypeStruct):
        flat = jax.ShapeDtypeStruct(table.shape[::-1], table.dtype)
      else:
        flat = np.asarray(table).T  # a view; `convert` copies it once
      stored = convert(flat, self.dtype)
      if stored is None:
        return 0
      self.coarse = nnx.Param(stored)
      self.coarse_layout = layout
    self.coarse_candidates = int(candidates)
    coarse = self.coarse.get_value()
    return math.prod(coarse.shape) * jnp.dtype(coarse.dtype).itemsize

  def drop_coarse_copy(self) -> None:
    """Removes the coarse copy (`add_coarse_copy`): a greedy pick reads the whole head again."""
    self.coarse = nnx.data(None)
    self.coarse_layout = None
    self.coarse_candidates = 0

  def candidates(self, x: jax.Array, backend: KernelBackend | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tokens the coarse copy ranks best, with their logits from the table itself.

    The coarse scores only choose which rows of the table are read: a candidate's logit is its row of `embedding`
    times `x`, summed in float32, as the whole head would make it (up to the order of the sums). So the greedy pick
    over the candidates is the whole head's whenever the head's best token is among them.

    Args:
      x: `[R, D]` hidden states.
      backend: the kernel backend of the coarse product (default: the reference backend).

    Returns:
      `[R, K]` int32 token ids (K = `coarse_candidates`, best coarse score first), `[R, K]` their logits in the
      compute dtype, and `[R]` whether each row's coarse scores are all finite.

    Raises:
      ValueError: the head has no coarse copy.
    """
    if self.coarse is None:
      raise ValueError("Embed.candidates needs a coarse copy of the head (add_coarse_copy); it has none")
    backend = default_backend() if backend is None else backend
    vocab = self.embedding.get_value().shape[0]
    x = x.astype(self.dtype)
    scores = backend.project(
        x,
        [self.coarse[...]],
        [None],
        num_in_axes=1,
        out_shapes=[(vocab,)],
        layouts=[self.coarse_layout],
        dtype=self.dtype,
    )[
        0
    ]  # [R, V]
    _, ids = jax.lax.top_k(scores, self.coarse_candidates)  # [R, K]
    rows = jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)  # [R, K, D]
    logits = jnp.einsum("rd,rkd->rk", x, rows, precision=jax.lax.Precision.HIGHEST)
    return ids.astype(jnp.int32), logits, jnp.all(jnp.isfinite(scores), axis=-1)
