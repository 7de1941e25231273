"""The kernel backend: the one place through which layers reach every runner op and every dense product.

A backend serves four ops on the paged (runner) path:
  - `ragged_paged_attention`: tpu-inference's `sharded_ragged_paged_attention` argument order, without the mesh
    (the backend holds it);
  - `gdn_attention`: the whole Gated DeltaNet core (causal conv over the state slots, SiLU, gated delta rule) in
    the argument order of tpu-inference's `run_jax_gdn_attention`, again with the mesh held by the backend;
  - `mamba2_attention`: the whole Mamba2 core (causal conv with bias over the state slots, SiLU, the selective
    state scan with the D skip), with the same per-request state metadata as `gdn_attention`;
  - `moe_experts`: the routed-expert computation of a mixture of experts;
the dense products the layers make on that path (`project`, `project_transposed`), and three hooks of the runner
that owns the parameters: `prepare_params` (lay the loaded parameters out for this backend, before the first
step), `compiler_options` (XLA options for a step program of a given size) and `place_params` (work on the
parameters' memory, run off the step path once the first step has run). So a TPU backend is a thin wrapper around
the runner's own kernels. The config key `kernel_backend` names the backend: `reference` (the pure-JAX ops of this
package, the oracle the others are tested against), `cpu` (this package's C++ kernels for one x86-64 CPU device,
`maxtext.kernels.cpu`), or one another package registers with `register_backend` (`tpu_inference`); empty means
the device's default (`device_default_name`). `get_backend(name, mesh, cfg)` builds it, and the model hands it down
to every layer's paged forward.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.configs.errors import ConfigError
from maxtext.kernels import experts, moe
from maxtext.kernels.ragged_conv1d import ragged_conv1d
from maxtext.kernels.ragged_gated_delta_rule import ragged_gated_delta_rule
from maxtext.kernels.ragged_mamba2 import ragged_mamba2
from maxtext.kernels.ragged_paged_attention import ragged_paged_attention

REFERENCE = "reference"
CPU = "cpu"
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


@runtime_checkable
class Relayable(Protocol):
  """A layer whose weight a backend may store in a layout of its own (`DenseGeneral`)."""

  def relayout(self, layout: str, convert: Callable[[Any, jnp.dtype], Any]) -> int:
    """Stores the weight as `convert(weight as [K, N], compute dtype)` returns (None: unchanged), tagged `layout`;
    returns the bytes now in that layout."""

  def restore_layout(self, convert: Callable[[Any], Any]) -> None:
    """Stores the weight in its canonical layout again, `convert` making the `[K, N]` matrix of the stored one."""


@runtime_checkable
class HeadCopyable(Protocol):
  """A tied head that a backend may give a copy of its table in a layout of its own (`Embed`)."""

  def add_head_copy(self, layout: str, convert: Callable[[Any, jnp.dtype], Any]) -> int:
    """Gives the head `convert(table^T as [D, V], compute dtype)` (None: no copy), tagged `layout`; returns its
    bytes."""

  def drop_head_copy(self) -> None:
    """Removes the copy: the head reads the table again."""

  def add_coarse_copy(self, layout: str, convert: Callable[[Any, jnp.dtype], Any], candidates: int) -> int:
    """Gives the head a coarse copy `convert(table^T as [D, V], compute dtype)` (None: no copy), tagged `layout`, that
    nominates `candidates` tokens of a greedy pick; returns its bytes."""

  def drop_coarse_copy(self) -> None:
    """Removes the coarse copy: a greedy pick reads the whole head again."""


class KernelBackend(abc.ABC):
  """The ops of the paged path; a backend implements all four. `mesh` is the device mesh (or None).

  The dense products and the runner hooks have plain defaults (XLA's dots; parameters as loaded; XLA's default
  compile options; nothing placed), which a backend with its own replaces.
  """

  name = "abstract"

  def __init__(self, mesh: jax.sharding.Mesh | None = None):
    self.mesh = mesh

  def configure(self, cfg: Any) -> None:
    """Reads this backend's options from the run config `cfg` (the plain backends have none).

    Raises:
      ConfigError: `cfg` sets `quantization` or `greedy_head_candidates`, which only the `cpu` backend's kernels
        read.
    """
    if cfg.get("quantization", ""):
      raise ConfigError(
          f"quantization={cfg.quantization!r} needs kernel_backend=cpu (its kernels read int8 weights);"
          f" kernel_backend={self.name} reads the weights in weight_dtype: leave quantization empty"
      )
    if cfg.get("greedy_head_candidates", 0):
      raise ConfigError(
          f"greedy_head_candidates={cfg.greedy_head_candidates} needs kernel_backend=cpu (its kernels read the"
          f" head's int4 copy); kernel_backend={self.name} reads the whole head: set greedy_head_candidates=0"
      )

  def project(
      self,
      x: jax.Array,
      kernels: Sequence[jax.Array],
      biases: Sequence[jax.Array | None],
      *,
      num_in_axes: int,
      out_shapes: Sequence[tuple[int, ...]],
      layouts: Sequence[str | None],
      dtype: jnp.dtype,
  ) -> tuple[jax.Array, ...]:
    """`x` contracted with each kernel, plus its bias: the projections a layer takes from one input.

    Args:
      x: `[..., *in]`, the last `num_in_axes` axes contracted.
      kernels: each `[*in, *out_shapes[i]]`, or in `layouts[i]` when that is not None (a layout this backend's
        `prepare_params` made).
      biases: `[*out_shapes[i]]` or None, one per kernel.
      num_in_axes: the number of contracted axes.
      out_shapes: each kernel's output axes.
      layouts: each kernel's layout (None: `[*in, *out]`).
      dtype: the compute dtype; x, kernels and biases are cast to it.

    Returns:
      One `[..., *out_shapes[i]]` in `dtype` per kernel.

    Raises:
      ValueError: a kernel is in a layout this backend does not read.
    """
    for i, layout in enumerate(layouts):
      if layout is not None:
        raise ValueError(
            f"kernel_backend={self.name}: kernels[{i}] is in the {layout!r} layout of another backend; this backend"
            " reads [*in, *out] kernels only (build the model anew, or use the backend that laid it out)"
        )
    del out_shapes  # each [*in, *out] kernel says its own
    x = x.astype(dtype)
    contract = ((tuple(range(x.ndim - num_in_axes, x.ndim)), tuple(range(num_in_axes))), ((), ()))
    ys = [jax.lax.dot_general(x, kernel.astype(dtype), contract) for kernel in kernels]
    return tuple(y if bias is None else y + bias.astype(dtype) for y, bias in zip(ys, biases))

  def project_transposed(self, x: jax.Array, table: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    """`x @ table^T` (a tied output head): x `[..., D]`, table `[V, D]` -> `[..., V]` in `dtype`."""
    return jnp.einsum("...d,vd->...v", x.astype(dtype), table.astype(dtype))

  def prepare_params(self, model: nnx.Module) -> int:  # pylint: disable=unused-argument  # the default keeps them
    """Lays `model`'s parameters out for this backend, in place (an abstract model too), before the first step.

    Returns:
      The bytes of parameters now in a layout of this backend's (0: the parameters are as loaded).
    """
    return 0

  def restore_params(self, model: nnx.Module) -> None:  # pylint: disable=unused-argument  # nothing to undo
    """Puts `model`'s parameters back in the canonical layout `prepare_params` took them from, in place: the layout
    the dense full-sequence forward and a checkpoint writer read."""

  def compiler_options(self, num_tokens: int) -> dict[str, str]:  # pylint: disable=unused-argument  # none here
    """XLA compile options for a step program of `num_tokens` (padded) tokens ({}: XLA's defaults)."""
    return {}

  def load_kernels(self) -> bool | None:
    """Loads and registers the backend's native kernels (called before a stored program that may call them is
    loaded); returns whether they are available, None when the backend has none (the default)."""
    return None

  def place_params(self, arrays: Sequence[jax.Array]) -> Callable[[], int] | None:  # pylint: disable=unused-argument
    """Work on the memory of the parameters' buffers `arrays`, for the runner to run in a thread once its first
    step has run; the work returns the bytes it placed. None: nothing to do (the default)."""
    return None

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
      num_kv_shards: int = 1,
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
      num_kv_shards: the tensor-parallel shards the cache's packed-head axis is laid out for (each shard packs its
        own heads, `kv_cache_layout.get_kv_cache_shape`).

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
  """This package's pure-JAX ops (they run anywhere JAX does; the mesh is left to XLA's sharding propagation).

  The Gated DeltaNet and Mamba2 ops are composed of a conv (`conv1d`) and a recurrence (`gated_delta_rule`,
  `mamba2_scan`), which a backend built on this one may replace one at a time.
  """

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
      num_kv_shards=1,
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
        num_kv_shards=num_kv_shards,
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
    conv_out, conv_state = self.conv1d(mixed_qkv, conv_state, conv_weight, conv_bias, *args)
    t = conv_out.shape[0]
    nkk = n_kq * d_k
    q = conv_out[:, :nkk].reshape(t, n_kq, d_k)
    k = conv_out[:, nkk : 2 * nkk].reshape(t, n_kq, d_k)
    v = conv_out[:, 2 * nkk :].reshape(t, n_v, d_v)
    out, recurrent_state = self.gated_delta_rule(q, k, v, b, a, A_log, dt_bias, recurrent_state, *args)
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
    conv_out, conv_state = self.conv1d(xbc, conv_state, conv_weight, conv_bias, *args, read_state_indices)
    t = conv_out.shape[0]
    x = conv_out[:, :inner].reshape(t, n_heads, head_dim)
    b = conv_out[:, inner : inner + bc].reshape(t, n_groups, state_dim)
    c = conv_out[:, inner + bc :].reshape(t, n_groups, state_dim)
    y, ssm_state = self.mamba2_scan(x, dt, b, c, A_log, D, dt_bias, ssm_state, *args, time_step_limit, read_state_indices)
    return (conv_state, ssm_state), y.reshape(t, inner)

  def conv1d(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The causal conv of the recurrent ops: `ragged_conv1d`'s arguments and result."""
    return ragged_conv1d(*args)

  def gated_delta_rule(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The Gated DeltaNet recurrence: `ragged_gated_delta_rule`'s arguments and result."""
    return ragged_gated_delta_rule(*args)

  def mamba2_scan(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The Mamba2 recurrence: `ragged_mamba2`'s arguments and result."""
    return ragged_mamba2(*args)

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
    return _EXPERT_FNS[method](x, weights, indices, w_gate, w_up, w_down, activation=activation, dtype=dtype, **extra)


CPU_BACKEND_MODULE = "maxtext.kernels.cpu.backend"


def _cpu_backend(mesh: jax.sharding.Mesh | None) -> KernelBackend:
  # The cpu package builds on this module's ReferenceBackend: it is imported by name, when first asked for.
  return importlib.import_module(CPU_BACKEND_MODULE).CpuBackend(mesh)


_BUILT_IN = (REFERENCE, CPU)
_BACKENDS: dict[str, Callable[[jax.sharding.Mesh | None], KernelBackend]] = {
    REFERENCE: ReferenceBackend,
    CPU: _cpu_backend,
}


def register_backend(name: str, factory: Callable[[jax.sharding.Mesh | None], KernelBackend]) -> None:
  """Makes `kernel_backend=<name>` build `factory(mesh)`.

  Raises:
    ValueError: an empty name, or the name of a built-in backend (reference, cpu).
  """
  if not isinstance(name, str) or not name.strip():
    raise ValueError(f"a kernel backend name must be a non-empty string, got {name!r}")
  if name in _BUILT_IN:
    raise ValueError(f"{name!r} is a built-in backend and cannot be replaced")
  _BACKENDS[name] = factory


def backend_names() -> tuple[str, ...]:
  """Registered backend names."""
  return tuple(sorted(_BACKENDS))


def device_default_name(mesh: jax.sharding.Mesh | None) -> str:
  """The backend a runner uses when the config names none (`kernel_backend: ""`): `cpu` on one CPU device (no
  mesh, or a mesh of one device), else `reference`."""
  one_device = mesh is None or mesh.size == 1
  return CPU if one_device and jax.default_backend() == "cpu" else REFERENCE


def get_backend(name: str, mesh: jax.sharding.Mesh | None = None, cfg: Any = None) -> KernelBackend:
  """The backend `kernel_backend=name` selects, holding `mesh`, with its options read from the run config `cfg`.

  An empty name is the reference backend here: a runner that wants the device's default asks
  `device_default_name` first.

  Raises:
    ConfigError: no backend of that name is registered, or it cannot run on this mesh.
  """
  name = name or REFERENCE
  if name not in _BACKENDS:
    raise ConfigError(f"kernel_backend={name!r}: must be one of {', '.join(backend_names())} (or empty)")
  backend = _BACKENDS[name](mesh)
  if cfg is not None:
    backend.configure(cfg)
  return backend


def default_backend() -> KernelBackend:
  """The reference backend without a mesh (dense paths and direct layer calls)."""
  return ReferenceBackend()
