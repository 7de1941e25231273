"""The kernel backend: the one place through which layers reach every runner op.

A backend serves four ops on the paged (runner) path:
  - `ragged_paged_attention`: tpu-inference's `sharded_ragged_paged_attention` argument order, without the mesh
    (the backend holds it);
  - `gdn_attention`: the whole Gated DeltaNet core (causal conv over the state slots, SiLU, gated delta rule) in
    the argument order of tpu-inference's `run_jax_gdn_attention`, again with the mesh held by the backend;
  - `mamba2_attention`: the whole Mamba2 core (causal conv with bias over the state slots, SiLU, the selective
    state scan with the D skip), with the same per-request state metadata as `gdn_attention`;
  - `moe_experts`: the routed-expert computation of a mixture of experts.
So a TPU backend is a thin wrapper around the runner's own kernels. The config key `kernel_backend` names the
backend (`reference`, the pure-JAX ops of this package, by default); `get_backend(name, mesh)` builds it, and the
model hands it down to every layer's paged forward. Another package registers more with `register_backend`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax

from maxtext.configs.errors import ConfigError
from maxtext.kernels import cpu_gemm, experts, moe
from maxtext.kernels.ragged_conv1d import ragged_conv1d
from maxtext.kernels.ragged_gated_delta_rule import ragged_gated_delta_rule
from maxtext.kernels.ragged_mamba2 import ragged_mamba2
from maxtext.kernels.ragged_paged_attention import ragged_paged_attention

REFERENCE = "reference"
# `method` of moe_experts. tiled: only the selected experts, a loop over one-expert tiles of the rows sorted by
# expert (the default: each expert computes only its own rows, where dense computes all of them); ragged: the same grouped
# matmul as `jax.lax.ragged_dot` (for backends with a native grouped matmul); dense: every expert on every token
# (the reference); gather: `[T, k, D, F]` weight copies (small T only).
_EXPERT_FNS = {
    "tiled": moe.experts_tiled,
    "ragged": moe.experts_ragged,
    "dense": experts.experts_dense,
    "gather": experts.experts_gather,
}
EXPERT_METHODS = tuple(_EXPERT_FNS)


class KernelBackend(abc.ABC):
  """The ops of the paged path; a backend implements all four. `mesh` is the device mesh (or None)."""

  name = "abstract"

  def __init__(self, mesh: jax.sharding.Mesh | None = None):
    self.mesh = mesh

  @abc.abstractmethod
  def ragged_paged_attention(  # pylint: disable=too-many-positional-arguments
      self,
      q: jax.Array,
      k: jax.Array | None,
      v: jax.Array | None,
      kv_cache: jax.Array,
      kv_lens: jax.Array,
      page_indices: jax.Array,
      cu_q_lens: jax.Array,
      distribution: jax.Array,
      attention_sink: jax.Array | None,
      sm_scale: float,
      attention_chunk_size: int | None = None,
      q_scale: float | None = None,
      k_scale: float | None = None,
      v_scale: float | None = None,
      update_kv_cache: bool = True,
      use_causal_mask: bool = True,
      attn_logits_soft_cap: float | None = None,
      *,
      num_kv_heads: int | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Writes the new K/V (unless `update_kv_cache=False`) and attends every query over its request's pages.

    Args:
      q: `[T, Hq, d]`.
      k, v: `[T, Hkv, d]`, or None for a KV-shared layer (then `update_kv_cache=False`, `num_kv_heads` set).
      kv_cache: `[N, bs, 2Hkv/pk, pk, Dpad]` paged cache.
      kv_lens: `[S]` KV length of each request after the step (`seq_lens`).
      page_indices: `[S * P]` block tables, row-major per request.
      cu_q_lens: `[S + 1]` query start locations.
      distribution: `[3]` request distribution (decodes, -, all).
      attention_sink: `[Hq]` fp32 sink logits, or None.
      sm_scale: logit scale.
      attention_chunk_size: sliding window W (self included), or None.
      q_scale, k_scale, v_scale: quantisation scales (None: unquantised).
      update_kv_cache: write the new K/V before attending.
      use_causal_mask: causal masking (the runner always asks for it).
      attn_logits_soft_cap: tanh soft cap, or None.
      num_kv_heads: the cache's real KV heads when k/v are None.

    Returns:
      `[T, Hq, d]` output and the cache after the step.
    """

  @abc.abstractmethod
  def gdn_attention(  # pylint: disable=too-many-positional-arguments
      self,
      mixed_qkv: jax.Array,
      b: jax.Array,
      a: jax.Array,
      conv_state: jax.Array,
      recurrent_state: jax.Array,
      conv_weight: jax.Array,
      conv_bias: jax.Array | None,
      A_log: jax.Array,  # pylint: disable=invalid-name  # the runner's argument name
      dt_bias: jax.Array,
      state_indices: jax.Array,
      query_start_loc: jax.Array,
      distribution: jax.Array,
      seq_lens: jax.Array,
      n_kq: int,
      n_v: int,
      d_k: int,
      d_v: int,
      kernel_size: int,
      read_state_indices: jax.Array | None = None,
  ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Gated DeltaNet over a ragged batch, each request continuing from its state slot.

    Args:
      mixed_qkv: `[T, C]` projected `[q nk*dk | k nk*dk | v nv*dv]` before the conv.
      b, a: `[T, nv]` beta and decay projections.
      conv_state: `[M, K-1, C]`.
      recurrent_state: `[M, nv, dk, dv]` fp32.
      conv_weight: `[C, 1, K]` depthwise conv weight (the runner's layout).
      conv_bias: `[C]` or None.
      A_log, dt_bias: `[nv]`.
      state_indices: `[S]` state slot each request writes its final state to (0: the null slot).
      query_start_loc: `[S + 1]`.
      distribution: `[3]`.
      seq_lens: `[S]` (a request has an initial state iff `seq_len > q_len` and its read slot is not 0).
      n_kq, n_v, d_k, d_v, kernel_size: head counts and sizes.
      read_state_indices: `[S]` slot each request reads its initial state from (None: `state_indices`), as
        tpu-inference 0.32.0's `run_jax_gdn_attention` takes it (prefix caching's "align" scheme).

    Returns:
      `((conv_state, recurrent_state), out [T, nv * dv])`.
    """

  @abc.abstractmethod
  def mamba2_attention(  # pylint: disable=too-many-positional-arguments
      self,
      xbc: jax.Array,
      dt: jax.Array,
      conv_state: jax.Array,
      ssm_state: jax.Array,
      conv_weight: jax.Array,
      conv_bias: jax.Array | None,
      A_log: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
      D: jax.Array,  # pylint: disable=invalid-name  # the checkpoint's parameter name
      dt_bias: jax.Array,
      state_indices: jax.Array,
      query_start_loc: jax.Array,
      distribution: jax.Array,
      seq_lens: jax.Array,
      n_heads: int,
      head_dim: int,
      n_groups: int,
      state_dim: int,
      kernel_size: int,
      time_step_limit: tuple[float, float] = (0.0, 0.0),
      read_state_indices: jax.Array | None = None,
  ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Mamba2 over a ragged batch, each request continuing from its state slot.

    Args:
      xbc: `[T, C]` projected `[x nh*hd | B G*N | C G*N]` before the conv.
      dt: `[T, nh]` time-step projections.
      conv_state: `[M, K-1, C]`.
      ssm_state: `[M, nh, hd, N]` fp32.
      conv_weight: `[C, 1, K]` depthwise conv weight (the runner's layout).
      conv_bias: `[C]` or None.
      A_log, D, dt_bias: `[nh]`.
      state_indices: `[S]` state slot of each request (0: the null slot).
      query_start_loc: `[S + 1]`.
      distribution: `[3]`.
      seq_lens: `[S]` (a request has an initial state iff `seq_len > q_len`).
      n_heads, head_dim, n_groups, state_dim, kernel_size: sizes.
      time_step_limit: `(lo, hi)` clamp of softplus(dt + dt_bias) (`hi = 0`: none).
      read_state_indices: `[S]` slot each request reads its initial state from (None: `state_indices`), as
        prefix caching's align scheme reads one state block and writes another.

    Returns:
      `((conv_state, ssm_state), y [T, nh * hd])`, y including the D skip (before the gated norm).
    """

  @abc.abstractmethod
  def moe_experts(  # pylint: disable=too-many-positional-arguments
      self,
      x: jax.Array,
      weights: jax.Array,
      indices: jax.Array,
      w_gate: jax.Array,
      w_up: jax.Array,
      w_down: jax.Array,
      *,
      activation: Callable[[jax.Array], jax.Array],
      dtype: Any,
      method: str = "tiled",
      b_gate: jax.Array | None = None,
      b_up: jax.Array | None = None,
      b_down: jax.Array | None = None,
      glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
  ) -> jax.Array:
    """Routed experts: x `[T, D]`, top-k weights and indices `[T, k]`, stacked weights -> `[T, D]`.

    Optional: per-expert biases `b_gate`, `b_up` `[E, F]` and `b_down` `[E, D]`, and `glu(gate, up)` replacing
    `activation(gate) * up` (gpt-oss's clamped SwiGLU).
    """


class ReferenceBackend(KernelBackend):
  """This package's pure-JAX ops (they run anywhere JAX does; the mesh is left to XLA's sharding propagation)."""

  name = REFERENCE

  def ragged_paged_attention(  # pylint: disable=too-many-positional-arguments
      self,
      q,
      k,
      v,
      kv_cache,
      kv_lens,
      page_indices,
      cu_q_lens,
      distribution,
      attention_sink,
      sm_scale,
      attention_chunk_size=None,
      q_scale=None,
      k_scale=None,
      v_scale=None,
      update_kv_cache=True,
      use_causal_mask=True,
      attn_logits_soft_cap=None,
      *,
      num_kv_heads=None,
  ):
    if not use_causal_mask:
      raise NotImplementedError("the reference ragged_paged_attention implements causal attention only")
    if any(s is not None for s in (q_scale, k_scale, v_scale)):
      raise NotImplementedError("the reference ragged_paged_attention takes no quantisation scales (q/k/v_scale)")
    return ragged_paged_attention(
        q,
        k,
        v,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        distribution,
        sinks=attention_sink,
        sm_scale=sm_scale,
        sliding_window=attention_chunk_size,
        soft_cap=attn_logits_soft_cap,
        update_kv_cache=update_kv_cache,
        num_kv_heads=num_kv_heads,
    )

  def gdn_attention(  # pylint: disable=too-many-positional-arguments
      self,
      mixed_qkv,
      b,
      a,
      conv_state,
      recurrent_state,
      conv_weight,
      conv_bias,
      A_log,
      dt_bias,
      state_indices,
      query_start_loc,
      distribution,
      seq_lens,
      n_kq,
      n_v,
      d_k,
      d_v,
      kernel_size,
      read_state_indices=None,
  ):
    if conv_weight.shape[-1] != kernel_size:
      raise ValueError(f"gdn_attention: conv_weight {conv_weight.shape} must be [C, 1, kernel_size={kernel_size}]")
    args = (state_indices, query_start_loc, seq_lens, distribution, read_state_indices)
    conv_out, conv_state = ragged_conv1d(mixed_qkv, conv_state, conv_weight, conv_bias, *args)
    t = conv_out.shape[0]
    nkk = n_kq * d_k
    q = conv_out[:, :nkk].reshape(t, n_kq, d_k)
    k = conv_out[:, nkk : 2 * nkk].reshape(t, n_kq, d_k)
    v = conv_out[:, 2 * nkk :].reshape(t, n_v, d_v)
    out, recurrent_state = ragged_gated_delta_rule(q, k, v, b, a, A_log, dt_bias, recurrent_state, *args)
    return (conv_state, recurrent_state), out.reshape(t, n_v * d_v)

  def mamba2_attention(  # pylint: disable=too-many-positional-arguments
      self,
      xbc,
      dt,
      conv_state,
      ssm_state,
      conv_weight,
      conv_bias,
      A_log,
      D,
      dt_bias,
      state_indices,
      query_start_loc,
      distribution,
      seq_lens,
      n_heads,
      head_dim,
      n_groups,
      state_dim,
      kernel_size,
      time_step_limit=(0.0, 0.0),
      read_state_indices=None,
  ):
    if conv_weight.shape[-1] != kernel_size:
      raise ValueError(f"mamba2_attention: conv_weight {conv_weight.shape} must be [C, 1, kernel_size={kernel_size}]")
    inner, bc = n_heads * head_dim, n_groups * state_dim
    if xbc.ndim != 2 or xbc.shape[1] != inner + 2 * bc:
      raise ValueError(
          f"mamba2_attention: xbc must be [T, nh*hd + 2*G*N] = [T, {inner + 2 * bc}]; got {tuple(xbc.shape)}"
      )
    args = (state_indices, query_start_loc, seq_lens, distribution)
    conv_out, conv_state = ragged_conv1d(xbc, conv_state, conv_weight, conv_bias, *args, read_state_indices)
    t = conv_out.shape[0]
    x = conv_out[:, :inner].reshape(t, n_heads, head_dim)
    b = conv_out[:, inner : inner + bc].reshape(t, n_groups, state_dim)
    c = conv_out[:, inner + bc :].reshape(t, n_groups, state_dim)
    y, ssm_state = ragged_mamba2(x, dt, b, c, A_log, D, dt_bias, ssm_state, *args, time_step_limit, read_state_indices)
    return (conv_state, ssm_state), y.reshape(t, inner)

  def moe_experts(  # pylint: disable=too-many-positional-arguments
      self,
      x,
      weights,
      indices,
      w_gate,
      w_up,
      w_down,
      *,
      activation,
      dtype,
      method="tiled",
      b_gate=None,
      b_up=None,
      b_down=None,
      glu=None,
  ):
    if method not in _EXPERT_FNS:
      raise ValueError(f"MoE method must be one of {EXPERT_METHODS}, got {method!r}")
    extra = {"b_gate": b_gate, "b_up": b_up, "b_down": b_down, "glu": glu}
    extra = {k: v for k, v in extra.items() if v is not None}  # the plain expert MLP passes no optional arguments
    fn = _EXPERT_FNS[method]
    if cpu_gemm.applies_experts(indices.size, dtype, w_gate.dtype, w_up.dtype, w_down.dtype):
      fn = moe.experts_cpu_rows  # the CPU kernel reads the selected experts in place (engine steps on one CPU)
    return fn(x, weights, indices, w_gate, w_up, w_down, activation=activation, dtype=dtype, **extra)


_BACKENDS: dict[str, Callable[[jax.sharding.Mesh | None], KernelBackend]] = {REFERENCE: ReferenceBackend}


def register_backend(name: str, factory: Callable[[jax.sharding.Mesh | None], KernelBackend]) -> None:
  """Makes `kernel_backend=<name>` build `factory(mesh)`.

  Raises:
    ValueError: an empty name, or the name of the built-in reference backend.
  """
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"a kernel backend name must be a non-empty string, got {name!r}")
  if name == REFERENCE:
    raise ValueError(f"{REFERENCE!r} is the built-in backend and cannot be replaced")
  _BACKENDS[name] = factory


def backend_names() -> tuple[str, ...]:
  """Registered backend names."""
  return tuple(sorted(_BACKENDS))


def get_backend(name: str, mesh: jax.sharding.Mesh | None = None) -> KernelBackend:
  """The backend `kernel_backend=name` selects, holding `mesh`.

  Raises:
    ConfigError: no backend of that name is registered.
  """
  if name not in _BACKENDS:
    raise ConfigError(f"kernel_backend={name!r}: must be one of {', '.join(backend_names())}")
  return _BACKENDS[name](mesh)


def default_backend() -> KernelBackend:
  """The reference backend without a mesh (dense paths and direct layer calls)."""
  return ReferenceBackend()
