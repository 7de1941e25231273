"""Token embedding with an optional sqrt(D) scale, and the tied output head (`attend`)."""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.kernels.backend import KernelBackend, default_backend
from maxtext.layers.initializers import draw_key, fan_in_uniform


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


class Embed(nnx.Module):
  """Token embedding table `embedding [V, D]` (init variance 1/D).

  A backend may give the tied head a copy of the table in a layout of its own (`add_head_copy`: `head`, tagged
  `head_layout`, e.g. weight-only int8 column panels of `[D, V]`); the lookups still read `embedding`.
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
