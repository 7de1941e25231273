"""Gated MLP: `down(act(gate(x)) * up(x))` with silu or tanh-approximated gelu; gpt-oss's clamped SwiGLU."""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.kernels.backend import KernelBackend
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.linears import DenseGeneral, project
from maxtext.layers.tensor_sources import linear, same, split_rows

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """gpt-oss's expert activation: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
  `g = min(gate, limit)` (the gate is clamped from above only)."""
  g = jnp.minimum(gate, limit)
  return (jnp.clip(up, -limit, limit) + 1.0) * (g * jax.nn.sigmoid(alpha * g))


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """Returns the activation function for `name` (silu | gelu_tanh)."""
  if name not in ACTIVATIONS:
    raise ValueError(f"mlp activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
  return ACTIVATIONS[name]


class MLP(nnx.Module):
  """Gated MLP with parameters `gate.kernel [D, F]`, `up.kernel [D, F]`, `down.kernel [F, D]` (+ biases)."""

  def __init__(
      self,
      emb_dim: int,
      mlp_dim: int,
      *,
      activation: str = "silu",
      use_bias: bool = False,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    get_activation(activation)
    self.activation = activation
    kw = {"use_bias": use_bias, "dtype": dtype, "weight_dtype": weight_dtype, "rngs": rngs}
    self.gate = DenseGeneral(emb_dim, mlp_dim, **kw)
    self.up = DenseGeneral(emb_dim, mlp_dim, **kw)
    self.down = DenseGeneral(mlp_dim, emb_dim, **kw)

  @classmethod
  def declare(cls, emb_dim: int, mlp_dim: int, *, use_bias: bool = False) -> list[ParamDecl]:
    """The parameters, filled from Hugging Face's `gate_proj`, `up_proj`, `down_proj` (Linear `[out, in]`)."""
    decls = [
        ParamDecl("gate.kernel", ("embed", "mlp"), linear("gate_proj.weight", mlp_dim, emb_dim)),
        ParamDecl("up.kernel", ("embed", "mlp"), linear("up_proj.weight", mlp_dim, emb_dim)),
        ParamDecl("down.kernel", ("mlp", "embed"), linear("down_proj.weight", emb_dim, mlp_dim)),
    ]
    if use_bias:
      decls += [
          ParamDecl("gate.bias", ("mlp",), same("gate_proj.bias", (mlp_dim,))),
          ParamDecl("up.bias", ("mlp",), same("up_proj.bias", (mlp_dim,))),
          ParamDecl("down.bias", ("embed",), same("down_proj.bias", (emb_dim,))),
      ]
    return decls

  @classmethod
  def declare_fused(cls, emb_dim: int, mlp_dim: int) -> list[ParamDecl]:
    """The parameters as Granite 4.0 stores them: `input_linear` `[2 F, D]` (gate rows first), `output_linear`."""
    gate_up = split_rows("input_linear.weight", (mlp_dim, mlp_dim), emb_dim)
    return [
        ParamDecl("gate.kernel", ("embed", "mlp"), gate_up, 0),
        ParamDecl("up.kernel", ("embed", "mlp"), gate_up, 1),
        ParamDecl("down.kernel", ("mlp", "embed"), linear("output_linear.weight", emb_dim, mlp_dim)),
    ]

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, backend: KernelBackend | None = None
  ) -> jax.Array:
    """`[..., D] -> [..., D]`, the products on `backend` (default: the reference backend)."""
    return self.finish(*project(x, (self.gate, self.up), backend), backend)

  def finish(self, gate: jax.Array, up: jax.Array, backend: KernelBackend | None = None) -> jax.Array:
    """The MLP from its gate and up projections (`gate(x)`, `up(x)`, which a caller may project together with
    other layers of the same input): `down(act(gate) * up)`, on `backend`."""
    return self.down(get_activation(self.activation)(gate) * up, backend)
