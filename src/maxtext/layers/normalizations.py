"""RMSNorm in both conventions: plain `w` (Llama, Qwen3, GDN) and zero-centred `1 + w` (Gemma3, Qwen3-Next/3.5)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers.declarations import ParamDecl
from maxtext.layers.initializers import ShapeOnlyRngs, constant
from maxtext.layers.tensor_sources import same


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float, zero_centered: bool) -> jax.Array:
  """Root-mean-square normalisation over the last axis, computed in float32.

  Plain (`zero_centered=False`): normalise in float32, cast to the input dtype, then multiply by `w`.
  Zero-centred: multiply by `1 + w` in float32, then cast (the two orders differ only in bfloat16).

  Args:
    x: `[..., N]` input.
    scale: `[N]` stored weight `w`.
    eps: added to the mean square inside the rsqrt.
    zero_centered: use `1 + w` instead of `w`.

  Returns:
    `[..., N]` in the dtype of `x`.
  """
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if zero_centered:
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return normed.astype(x.dtype) * scale.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, *, eps: float) -> jax.Array:
  """Gated DeltaNet output norm: `rmsnorm(x) * w * silu(gate)` with plain `w`.

  Args:
    x: `[..., N]` input.
    gate: `[..., N]` gate `z`.
    scale: `[N]` weight `w`.
    eps: RMSNorm epsilon.

  Returns:
    `[..., N]` in the dtype of `x`.
  """
  normed = rms_norm(x, scale, eps=eps, zero_centered=False)
  return (normed.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with parameter `scale [N]` (init 1 plain, 0 zero-centred)."""

  def __init__(
      self,
      num_features: int,
      *,
      eps: float,
      zero_centered: bool,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs | ShapeOnlyRngs | None = None,
  ):
    if num_features <= 0:
      raise ValueError(f"RMSNorm num_features must be positive, got {num_features}")
    self.eps = float(eps)
    self.zero_centered = bool(zero_centered)
    self.scale = nnx.Param(constant(rngs, (num_features,), weight_dtype, 0.0 if zero_centered else 1.0))

  @classmethod
  def declare(cls, num_features: int, tensor: str, axis: str | None = "embed") -> list[ParamDecl]:
    """`scale [N]` along logical `axis`, stored as Hugging Face's `tensor` (a norm's `.weight`)."""
    return [ParamDecl("scale", (axis,), same(tensor, (num_features,)))]

  def __call__(self, x: jax.Array) -> jax.Array:  # pylint: disable=arguments-differ  # nnx call hook
    """Normalises `[..., N]` -> `[..., N]` (input dtype)."""
    return rms_norm(x, self.scale[...], eps=self.eps, zero_centered=self.zero_centered)
