"""Token embedding with an optional sqrt(D) scale, and the tied output head (`attend`)."""

import math

import jax
import jax.numpy as jnp
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
  """Token embedding table `embedding [V, D]` (init variance 1/D)."""

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

  def __call__(self, tokens: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """Embeds `[...]` ids -> `[..., D]`."""
    return embed_tokens(self.embedding[...], tokens, scale=self.scale, dtype=self.dtype)

  def attend(self, x: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """Tied head on `backend` (default: the reference backend): `[..., D]` -> `[..., V]`."""
    return attend(self.embedding[...], x, dtype=self.dtype, backend=backend)
