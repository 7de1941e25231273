"""`kernel_backend=cpu`: the reference ops with this package's C++ kernels where they serve, on one CPU device.

The kernels (`cpu_gemm`: small-batch and column-panel products, routed experts; `cpu_attention`; `cpu_gated_delta`;
`cpu_mamba2`) are compiled from the sources in this folder on first use (`cpu_gemm.load`). Each op takes the
kernel when its `applies` says the operands fit (float32 activations, float32 or - for the dense products - bfloat16
weights read as stored, the sizes the kernel takes, the library loaded) and the reference backend's pure-JAX op
otherwise, so the results are the reference's within float32 rounding and a machine without a compiler or AVX2 runs
the reference ops. The runner hooks: `prepare_params` stores the float32 and bfloat16 dense kernels in column panels
(`cpu_weight_panels`), `compiler_options` turns YNNPACK's fusions off for steps of
1 to `cpu_gemm.MAX_ROWS` tokens, and `place_params` moves the weights onto 2 MiB pages (`huge_page_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.configs.errors import ConfigError
from maxtext.kernels import ragged_batch
from maxtext.kernels.backend import CPU, EXPERT_METHODS, HeadCopyable, ReferenceBackend, Relayable
from maxtext.kernels.cpu import cpu_attention, cpu_gated_delta, cpu_gemm, cpu_mamba2, cpu_moe, huge_pages
from maxtext.kernels.ragged_conv1d import ragged_conv1d
from maxtext.kernels.ragged_gated_delta_rule import gated_delta_operands
from maxtext.kernels.ragged_mamba2 import mamba2_operands
from maxtext.kernels.ragged_paged_attention import write_kv

PANELS = "panels"  # the layout name of a kernel in column panels (`cpu_gemm.to_panels`)
PANELS_INT8 = "panels_int8"  # weight-only int8 column panels (`cpu_gemm.to_int8_panels`, `quantization=int8w`)
PANELS_INT4 = "panels_int4"  # int4 column panels (`cpu_gemm.to_int4_panels`): a tied head's coarse copy
INT8W = "int8w"  # the `quantization` value of weight-only int8


def to_panels(flat: Any, dtype: jnp.dtype) -> Any:
  """`flat [K, N]` in column panels, in its own dtype, or None when panels do not serve it (a weight dtype the kernel
  does not read, `cpu_gemm.WEIGHT_DTYPES`; a compute `dtype` other than float32; N not a multiple of
  `cpu_gemm.PANEL` or over `cpu_gemm.MAX_PANEL_COLUMNS`). Takes a `jax.ShapeDtypeStruct` too."""
  n = flat.shape[1]
  if n % cpu_gemm.PANEL or n > cpu_gemm.MAX_PANEL_COLUMNS or not _kernel_reads(flat, dtype):
    return None
  return cpu_gemm.to_panels(flat)


def _kernel_reads(flat: Any, dtype: jnp.dtype) -> bool:
  """Whether the kernel reads `flat`'s weight dtype (`cpu_gemm.WEIGHT_DTYPES`) in a layer of compute `dtype` (float32
  only)."""
  return jnp.dtype(flat.dtype) in cpu_gemm.WEIGHT_DTYPES and jnp.dtype(dtype) == jnp.float32


def to_int8_panels(flat: Any, dtype: jnp.dtype) -> Any:
  """`flat [K, N]` in weight-only int8 column panels, or None when they do not serve it (K not a multiple of
  `cpu_gemm.PANEL`, or whatever `to_panels` declines). Takes a `jax.ShapeDtypeStruct` too."""
  if flat.shape[0] % cpu_gemm.PANEL or to_panels(jax.ShapeDtypeStruct(flat.shape, flat.dtype), dtype) is None:
    return None
  return cpu_gemm.to_int8_panels(flat)


def to_int8_head(flat: Any, dtype: jnp.dtype) -> Any:
  """A tied head's `[D, V]` table in weight-only int8 column panels, or None when they do not serve it (D or V not a
  multiple of `cpu_gemm.PANEL`, another weight dtype, a compute dtype other than float32). Unlike a layer's
  kernel, any width goes into panels: at one row, a row-major table is read at its full width, and int8 halves or
  quarters what a step reads. Takes a `jax.ShapeDtypeStruct` too."""
  if flat.shape[0] % cpu_gemm.PANEL or flat.shape[1] % cpu_gemm.PANEL or not _kernel_reads(flat, dtype):
    return None
  return cpu_gemm.to_int8_panels(flat)


def to_int4_head(flat: Any, dtype: jnp.dtype) -> Any:
  """A tied head's `[D, V]` table as int4 column panels, its coarse copy (`greedy_head_candidates`), or None when they
  do not serve it (as `to_int8_head`, or the library reads int8 panels without the integer dot products that int4
  panels need, `cpu_gemm.int8_dot_reason`). Takes a `jax.ShapeDtypeStruct` too."""
  if cpu_gemm.int8_dot_reason() is not None or to_int8_head(jax.ShapeDtypeStruct(flat.shape, flat.dtype), dtype) is None:
    return None
  return cpu_gemm.to_int4_panels(flat)


def kernel_state_slots(  # pylint: disable=too-many-positional-arguments
    num_tokens: int,
    state_indices: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    distribution: jax.Array,
    read_state_indices: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The `(read, write)` int32 `[S]` slots of the recurrent kernels (`cpu_gated_delta`, `cpu_mamba2`): a
  request reads its read slot (`read_state_indices`, else `state_indices`) when it `has_initial_state`, else -1
  (zeros), and writes `state_indices`."""
  layout = ragged_batch.token_layout(num_tokens, query_start_loc, distribution)
  has_init = ragged_batch.has_initial_state(layout, seq_lens, read_state_indices)
  read = state_indices if read_state_indices is None else read_state_indices
  return jnp.where(has_init, read.astype(jnp.int32), -1), state_indices.astype(jnp.int32)


class CpuBackend(ReferenceBackend):
  """The reference ops, with the C++ kernels where they serve (one CPU device; see the module docstring).

  Raises:
    ConfigError: the mesh has more than one device, or JAX's default device is not a CPU.
  """

  name = CPU

  def __init__(self, mesh: jax.sharding.Mesh | None = None):
    if mesh is not None and mesh.size > 1:
      raise ConfigError(
          f"kernel_backend={CPU} runs on one CPU device (its kernels do not partition); the mesh has {mesh.size}"
          " devices: use kernel_backend=reference, or ici_*_parallelism=1"
      )
    if jax.default_backend() != "cpu":
      raise ConfigError(f"kernel_backend={CPU} needs JAX's CPU device; JAX's default is {jax.default_backend()}")
    super().__init__(mesh)
    self.weight_panels = True
    self.huge_pages = True
    self.int8_weights = False
    self.greedy_head_candidates = 0

  def configure(self, cfg: Any) -> None:
    """Reads `cpu_weight_panels`, `huge_page_weights`, `quantization` and `greedy_head_candidates` from the run
    config."""
    self.weight_panels = bool(cfg.cpu_weight_panels)
    self.huge_pages = bool(cfg.huge_page_weights)
    self.int8_weights = cfg.get("quantization", "") == INT8W
    self.greedy_head_candidates = int(cfg.get("greedy_head_candidates", 0))

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
    """The reference's products; the kernel takes every kernel at 1 to 8 rows, and kernels in panels at any number
    of rows, in one call (each result bit for bit that of its own call). A float32 or bfloat16 kernel goes to the
    kernel as it is stored (a weight-only bfloat16 model reads half the bytes; the sums are float32). The others
    are XLA dots in `dtype` (a kernel in panels outside the kernel's reach is copied out of them for its dot)."""
    for i, layout in enumerate(layouts):
      if layout not in (None, PANELS, PANELS_INT8, PANELS_INT4):
        raise ValueError(f"kernel_backend={CPU}: kernels[{i}] is in the unknown layout {layout!r}")
    x = x.astype(dtype)
    batch_shape, in_shape = x.shape[: x.ndim - num_in_axes], x.shape[x.ndim - num_in_axes :]
    rows, size_in = math.prod(batch_shape), math.prod(in_shape)
    dtypes = (x.dtype, *(kernel.dtype for kernel in kernels))
    small, any_rows = cpu_gemm.applies(rows, *dtypes), cpu_gemm.applies_panels(rows, *dtypes)
    in_panels = [layout in (PANELS, PANELS_INT8, PANELS_INT4) for layout in layouts]
    on_kernel = [i for i, panels in enumerate(in_panels) if small or (panels and any_rows)]
    ys: list[jax.Array | None] = [None] * len(kernels)
    if on_kernel:
      flat_x = x.reshape(rows, size_in)
      flat = [kernels[i] if in_panels[i] else kernels[i].reshape(size_in, math.prod(out_shapes[i])) for i in on_kernel]
      flats = (cpu_gemm.matmul(flat_x, flat[0]),) if len(on_kernel) == 1 else cpu_gemm.matmuls(flat_x, flat)
      for i, y in zip(on_kernel, flats):
        ys[i] = y.reshape(batch_shape + tuple(out_shapes[i]))
    contract = ((tuple(range(x.ndim - num_in_axes, x.ndim)), tuple(range(num_in_axes))), ((), ()))
    for i, kernel in enumerate(kernels):
      if ys[i] is None:
        if in_panels[i]:
          unpack = {PANELS_INT8: cpu_gemm.from_int8_panels, PANELS_INT4: cpu_gemm.from_int4_panels}.get(
              layouts[i], cpu_gemm.from_panels
          )
          kernel = unpack(kernel).reshape(in_shape + tuple(out_shapes[i]))
        ys[i] = jax.lax.dot_general(x, kernel.astype(dtype), contract)
    return tuple(y if bias is None else y + bias.astype(dtype) for y, bias in zip(ys, biases))

  def project_transposed(self, x: jax.Array, table: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    """The reference's tied head; the kernel streams the `[V, D]` table, float32 or bfloat16 as stored, at 1 to 8
    rows."""
    x = x.astype(dtype)
    rows = math.prod(x.shape[:-1])
    if cpu_gemm.applies(rows, x.dtype, table.dtype):
      return cpu_gemm.matmul_transposed(x.reshape(rows, x.shape[-1]), table).reshape(x.shape[:-1] + (-1,))
    return super().project_transposed(x, table, dtype=dtype)

  def prepare_params(self, model: nnx.Module) -> int:
    """With `cpu_weight_panels` and the kernel loaded, every float32 or bfloat16 dense kernel of a float32 layer that
    panels serve (`to_panels`) goes into column panels, in place (an abstract model too); with
    `quantization=int8w`, into int8 panels where they serve (`to_int8_panels`), and a tied head gets an int8 panel
    copy of its table (the head reads all of it every step; the lookups keep the table). With
    `greedy_head_candidates`, a tied head gets an int4 panel copy that nominates that many candidates of a greedy
    pick (`to_int4_head`, `Embed.candidates`). Returns the bytes now in a layout."""
    if not self.weight_panels or not cpu_gemm.load():
      return 0
    total = 0
    for _, layer in nnx.iter_modules(model):
      if self.int8_weights and isinstance(layer, HeadCopyable):
        total += layer.add_head_copy(PANELS_INT8, to_int8_head)
      if self.greedy_head_candidates and isinstance(layer, HeadCopyable):
        total += layer.add_coarse_copy(PANELS_INT4, to_int4_head, self.greedy_head_candidates)
      if not isinstance(layer, Relayable):
        continue
      if self.int8_weights and getattr(layer, "layout", None) in (None, PANELS_INT8):
        total += layer.relayout(PANELS_INT8, to_int8_panels)
      if getattr(layer, "layout", None) != PANELS_INT8:
        total += layer.relayout(PANELS, to_panels)
    return total

  def restore_params(self, model: nnx.Module) -> None:
    """Every kernel in column panels back to `[*in, *out]` (`from_panels`; int8 panels dequantized to float32,
    `from_int8_panels`), in place."""
    for _, layer in nnx.iter_modules(model):
      if isinstance(layer, HeadCopyable):
        layer.drop_head_copy()
        layer.drop_coarse_copy()
      layout = getattr(layer, "layout", None) if isinstance(layer, Relayable) else None
      if layout == PANELS:
        layer.restore_layout(cpu_gemm.from_panels)
      elif layout == PANELS_INT8:
        layer.restore_layout(cpu_gemm.from_int8_panels)

  def compiler_options(self, num_tokens: int) -> dict[str, str]:
    """YNNPACK's fusions off for steps of 1 to `cpu_gemm.MAX_ROWS` tokens, once the kernel has loaded."""
    if cpu_gemm.small_batch_program(num_tokens) and cpu_gemm.load():
      return cpu_gemm.small_batch_compiler_options()
    return {}

  def load_kernels(self) -> bool:
    """Builds (once) and registers the C++ kernels with XLA's FFI (`cpu_gemm.load`); whether they are available."""
    return cpu_gemm.load()

  def place_params(self, arrays: Sequence[jax.Array]) -> Callable[[], int] | None:
    """With `huge_page_weights`, the work of backing the buffers of `arrays` with 2 MiB pages (`huge_pages`)."""
    if not self.huge_pages:
      return None
    ranges = huge_pages.buffer_ranges(arrays)
    return lambda: huge_pages.collapse(ranges)

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
    kernel = cpu_attention.applies(
        q.dtype, kv_cache.dtype, mask_value=None, soft_cap=attn_logits_soft_cap, sliding_window=attention_chunk_size
    )
    # The C++ kernel reads the unsharded layout (one device); a cache laid out per shard takes the XLA path.
    unsupported = num_kv_shards != 1 or not use_causal_mask or any(s is not None for s in (q_scale, k_scale, v_scale))
    if not kernel or unsupported:
      return super().ragged_paged_attention(
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
          attention_chunk_size,
          q_scale,
          k_scale,
          v_scale,
          update_kv_cache,
          use_causal_mask,
          attn_logits_soft_cap,
          num_kv_heads=num_kv_heads,
          num_kv_shards=num_kv_shards,
      )
    # The K/V write stays in XLA; the kernel reads only the keys each token sees, in place.
    new_cache, num_kv_heads = write_kv(
        q,
        k,
        v,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        distribution,
        sinks=attention_sink,
        update_kv_cache=update_kv_cache,
        num_kv_heads=num_kv_heads,
    )
    out = cpu_attention.attend(
        q,
        new_cache,
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        distribution.astype(jnp.int32),
        num_kv_heads=num_kv_heads,
        sm_scale=sm_scale,
        sliding_window=attention_chunk_size,
        soft_cap=attn_logits_soft_cap,
        sinks=attention_sink,
    )
    return out, new_cache

  def conv1d(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The reference conv; a step of up to `cpu_gemm.MAX_ROWS` tokens, which compiles without YNNPACK's fusions
    (`compiler_options`), sums its taps in one fused loop instead of a dot."""
    return ragged_conv1d(*args, sum_taps=bool(self.compiler_options(args[0].shape[0])))

  def gated_delta_rule(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The recurrence of every request on its state slot, in place, by `cpu_gated_delta` (float32), else the
    reference's scan."""
    q, _, v, _, _, _, _, recurrent_state, state_indices, query_start_loc, seq_lens, distribution, *read = args
    qf, kf, vf, beta, decay = gated_delta_operands(*args)
    if not cpu_gated_delta.applies(qf.dtype, vf.dtype, recurrent_state.dtype):
      return super().gated_delta_rule(*args)
    read_slots, write_slots = kernel_state_slots(
        q.shape[0], state_indices, query_start_loc, seq_lens, distribution, *read
    )
    out, new_state = cpu_gated_delta.gated_delta(
        qf,
        kf,
        vf,
        beta,
        decay,
        query_start_loc.astype(jnp.int32),
        read_slots,
        write_slots,
        distribution.astype(jnp.int32),
        recurrent_state,
    )
    return out.astype(v.dtype), new_state

  def mamba2_scan(self, *args: Any) -> tuple[jax.Array, jax.Array]:
    """The recurrence of every request on its state slot, in place, by `cpu_mamba2` (float32), else the
    reference's scan (each head reads its group's B and C rows, not repeated per head)."""
    x, _, b, c, _, skip, _, ssm_state, state_indices, query_start_loc, seq_lens, distribution, *rest = args
    xf, delta, decay = mamba2_operands(*args)
    if not cpu_gated_delta.applies(xf.dtype, ssm_state.dtype):
      return super().mamba2_scan(*args)
    read = rest[1:] if len(rest) > 1 else ()
    read_slots, write_slots = kernel_state_slots(
        x.shape[0], state_indices, query_start_loc, seq_lens, distribution, *read
    )
    y, new_state = cpu_mamba2.mamba2(
        xf,
        delta,
        decay,
        b.astype(jnp.float32),
        c.astype(jnp.float32),
        skip.astype(jnp.float32),
        query_start_loc.astype(jnp.int32),
        read_slots,
        write_slots,
        distribution.astype(jnp.int32),
        ssm_state,
    )
    return y.astype(x.dtype), new_state

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
    """The reference's experts; up to `cpu_gemm.MAX_EXPERT_ROWS` float32 (token, choice) rows, whatever the method,
    run on the kernel, which reads the selected experts in place (`cpu_moe.experts_cpu_rows`)."""
    biases = {"b_gate": b_gate, "b_up": b_up, "b_down": b_down, "glu": glu}
    operands = (x, weights, indices, w_gate, w_up, w_down)
    if method not in EXPERT_METHODS or not cpu_gemm.applies_experts(
        indices.size, dtype, w_gate.dtype, w_up.dtype, w_down.dtype
    ):
      return super().moe_experts(*operands, activation=activation, dtype=dtype, method=method, **biases)
    return cpu_moe.experts_cpu_rows(*operands, activation=activation, dtype=dtype, **biases)
