"""`kernel_backend=tpu_inference`: the paged-path ops through tpu-inference 0.32.0's own TPU kernels.

Attention calls `tpu_inference.layers.common.attention_interface.sharded_ragged_paged_attention` and Gated DeltaNet
calls `tpu_inference.layers.common.gdn_attention.run_jax_gdn_attention`, both with 0.32.0's positional argument
order and the runner's mesh (docs/runner-contract.md). The routed experts stay on this package's pure-JAX op;
Mamba2 (`mamba2_attention`) has no tpu-inference op to call and raises NotImplementedError. The
functions are looked up when the backend is built (inside the runner's process, where tpu-inference is installed);
without tpu-inference that is an error naming the package. Nothing here runs on CPU in this repository's tests
except through a recording fake of the two functions.

What the wrapper adds to a plain call:
- KV-sharing layers read without writing (`update_kv_cache=False`), but the upstream function still shards k and v,
  so it gets zero-filled ones of the cache's head count.
- k and v are cast to the cache dtype (the upstream kernel requires them equal).
- `read_state_indices` (prefix caching: read the initial state from one slot, write to another) is passed on
  positionally after the mesh, as 0.32.0's `run_jax_gdn_attention` takes it; without one, `state_indices`, its
  own default.
- `run_jax_gdn_attention` splits the `[q | k | v]` channels of `mixed_qkv` (and of the conv weight and bias)
  into contiguous blocks, one per tensor-parallel shard, so each shard must find its own heads' `[q | k | v]` in its
  block: for more than one shard the channels are reordered into that per-shard layout first. The conv state the
  kernel keeps is then in the same per-shard order, consistently from step to step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.integration.vllm.environment import PluginEnvironmentError, import_module_of
from maxtext.kernels.backend import REFERENCE, ReferenceBackend, register_backend
from maxtext.kv_cache.kv_cache_layout import get_dtype_packing

TPU_INFERENCE = "tpu_inference"
ATTENTION_MODULE = "tpu_inference.layers.common.attention_interface"
GDN_MODULE = "tpu_inference.layers.common.gdn_attention"
# The mesh axes tpu-inference shards attention and GDN heads over (its ATTN_HEAD); absent axes count as size 1.
HEAD_AXES = ("model", "expert", "dcp")
# tpu-inference 0.32.0's GDN kernel (kernels/gdn/v3) loads every key and value head as whole columns of the TPU's
# 128 vector lanes, so both head dims must be multiples of it (Qwen3-Next and Qwen3.5 use 128).
GDN_HEAD_DIM_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class TpuInferenceOps:
  """The two tpu-inference functions the backend calls."""

  sharded_ragged_paged_attention: Callable[..., Any]
  run_jax_gdn_attention: Callable[..., Any]


def load_tpu_inference_ops() -> TpuInferenceOps:
  """Looks the two functions up in the installed tpu-inference.

  Raises:
    PluginEnvironmentError: tpu-inference cannot be imported or lacks one of the functions.
  """
  attention = import_module_of(ATTENTION_MODULE, "tpu-inference", f"kernel_backend={TPU_INFERENCE}")
  gdn = import_module_of(GDN_MODULE, "tpu-inference", f"kernel_backend={TPU_INFERENCE}")
  ops = {}
  for module, name in ((attention, "sharded_ragged_paged_attention"), (gdn, "run_jax_gdn_attention")):
    fn = getattr(module, name, None)
    if not callable(fn):
      raise PluginEnvironmentError(
          f"kernel_backend={TPU_INFERENCE}: {module.__name__} has no callable {name}; this backend calls "
          "tpu-inference 0.32.0's"
      )
    ops[name] = fn
  return TpuInferenceOps(**ops)


def head_shards(mesh: jax.sharding.Mesh) -> int:
  """How many shards tpu-inference splits heads into on `mesh` (the product of its head axes present)."""
  return int(np.prod([mesh.shape[axis] for axis in HEAD_AXES if axis in mesh.shape], dtype=np.int64))


def per_shard_channel_order(n_kq: int, n_v: int, d_k: int, d_v: int, shards: int) -> np.ndarray:
  """Channel permutation taking `[q | k | v]` to `[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]`, one block per shard.

  Raises:
    ValueError: the key or value heads do not split evenly over the shards.
  """
  if n_kq % shards or n_v % shards:
    raise ValueError(
        f"kernel_backend={TPU_INFERENCE}: Gated DeltaNet key heads ({n_kq}) and value heads ({n_v}) must both be"
        f" multiples of the tensor-parallel size ({shards})"
    )
  key_dim, k_per, v_per = n_kq * d_k, n_kq // shards * d_k, n_v // shards * d_v
  blocks = []
  for s in range(shards):
    blocks.append(np.arange(s * k_per, (s + 1) * k_per))  # this shard's q heads
    blocks.append(key_dim + np.arange(s * k_per, (s + 1) * k_per))  # its k heads
    blocks.append(2 * key_dim + np.arange(s * v_per, (s + 1) * v_per))  # its v heads
  return np.concatenate(blocks)


def _check_sinks_fit_the_hd64_kernel(q: jax.Array, num_kv_heads: int) -> None:
  """tpu-inference 0.32.0's head-dim-64 kernel (the one that takes sinks) pads each KV head's query heads to whole
  groups of the query dtype's packing but reshapes the sinks to that padded count unpadded
  (`kernel_hd64.prepare_inputs`), so it fails unless the query heads per KV head fill whole groups.

  Raises:
    NotImplementedError: naming the head counts and the dtype.
  """
  per_kv = q.shape[1] // num_kv_heads
  packing = get_dtype_packing(q.dtype)
  if per_kv % packing:
    raise NotImplementedError(
        f"kernel_backend={TPU_INFERENCE}: tpu-inference's head_dim-64 attention kernel takes attention sinks only"
        f" with a multiple of {packing} query heads per KV head in {jnp.dtype(q.dtype).name}; this layer has"
        f" {q.shape[1]} query heads over {num_kv_heads} cache KV heads (after padding to the tensor-parallel size)"
    )


class TpuInferenceBackend(ReferenceBackend):
  """Attention and Gated DeltaNet through tpu-inference's kernels on the runner's mesh; MoE stays pure JAX."""

  name = TPU_INFERENCE

  def __init__(self, mesh: jax.sharding.Mesh | None = None, ops: TpuInferenceOps | None = None):
    """Builds the backend on `mesh` (required: the upstream functions shard over it).

    Raises:
      PluginEnvironmentError: tpu-inference is not installed (when `ops` is not given).
      ValueError: no mesh.
    """
    ops = load_tpu_inference_ops() if ops is None else ops
    if mesh is None:
      raise ValueError(f"kernel_backend={TPU_INFERENCE} needs the runner's device mesh; got mesh=None")
    super().__init__(mesh)
    self.ops = ops

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
    # tpu-inference's kernel runs per shard under its own shard_map, where each shard's block of the packed-head
    # axis is the layout of its own heads: `num_kv_shards` describes that and needs no argument of its own.
    del num_kv_shards
    if k is None or v is None:
      if update_kv_cache or num_kv_heads is None:
        raise ValueError(
            "ragged_paged_attention: k and v may be None only for a KV-sharing read (update_kv_cache=False with"
            f" num_kv_heads set); got update_kv_cache={update_kv_cache}, num_kv_heads={num_kv_heads}"
        )
      k = v = jnp.zeros((q.shape[0], num_kv_heads, q.shape[2]), kv_cache.dtype)
    if attention_sink is not None:
      _check_sinks_fit_the_hd64_kernel(q, k.shape[1])
    out, new_cache = self.ops.sharded_ragged_paged_attention(
        self.mesh,
        q,
        k.astype(kv_cache.dtype),
        v.astype(kv_cache.dtype),
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
    )
    return out, new_cache

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
    if d_k % GDN_HEAD_DIM_MULTIPLE or d_v % GDN_HEAD_DIM_MULTIPLE:
      raise ValueError(
          f"kernel_backend={TPU_INFERENCE}: tpu-inference's Gated DeltaNet kernel needs gdn_key_head_dim and"
          f" gdn_value_head_dim that are multiples of {GDN_HEAD_DIM_MULTIPLE} (the TPU's vector lanes); got {d_k} and"
          f" {d_v}; use kernel_backend={REFERENCE} for this model"
      )
    shards = head_shards(self.mesh)
    if shards > 1:
      order = jnp.asarray(per_shard_channel_order(n_kq, n_v, d_k, d_v, shards))
      mixed_qkv = jnp.take(mixed_qkv, order, axis=1)
      conv_weight = jnp.take(conv_weight, order, axis=0)
      conv_bias = None if conv_bias is None else jnp.take(conv_bias, order, axis=0)
    return self.ops.run_jax_gdn_attention(
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
        self.mesh,
        state_indices if read_state_indices is None else read_state_indices,  # 0.32.0's own default
    )

  def moe_experts(self, *args, method="tiled", **kwargs):  # pylint: disable=too-many-positional-arguments
    """The routed experts as one grouped matmul (`jax.lax.ragged_dot`, which XLA runs natively on TPU) where the layer
    asks for the default `tiled` form, the loop over expert tiles meant for backends without a grouped matmul: on a
    TPU the tiles' gathers and padding are what a prefill's temporaries grow with."""
    return super().moe_experts(*args, method="ragged" if method == "tiled" else method, **kwargs)

  def mamba2_attention(self, *args, **kwargs):  # pylint: disable=too-many-positional-arguments
    """Not served: tpu-inference 0.32.0 has no Mamba2 op this backend could call, and falling back to the
    reference scan on TPU would silently run a slow path.

    Raises:
      NotImplementedError: always, naming the backend and the layer kind.
    """
    del args, kwargs
    raise NotImplementedError(
        f"kernel_backend={TPU_INFERENCE} cannot run mamba layers (Granite 4.0, Bamba): tpu-inference 0.32.0 has no"
        f" Mamba2 kernel to call; use kernel_backend={REFERENCE}"
    )


register_backend(TPU_INFERENCE, TpuInferenceBackend)
