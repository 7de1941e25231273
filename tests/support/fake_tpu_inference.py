"""A recording stand-in for the two tpu-inference 0.32.0 functions `kernel_backend=tpu_inference` calls.

`RecordingTpuInference` offers `sharded_ragged_paged_attention` and `run_jax_gdn_attention` with 0.32.0's positional
signatures (written here from docs/runner-contract.md, not imported). Each call is checked (every argument
positional, in 0.32.0's order, with the shapes and dtypes the upstream kernels require), recorded, and answered
with this package's reference ops, so a model runs through it end to end on CPU. GDN is answered shard by shard,
the way the upstream `shard_map` splits channels and heads over the mesh's head axes, so the per-shard channel
layout the backend must produce is exercised too. `modules()` gives `sys.modules` entries that make the two
functions importable under their upstream module names.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.kernels.backend import ReferenceBackend
from maxtext.kv_cache.kv_cache_layout import get_kv_cache_shape

RPA_PARAMETERS = (
    "mesh",
    "q",
    "k",
    "v",
    "kv_cache",
    "kv_lens",
    "page_indices",
    "cu_q_lens",
    "distribution",
    "attention_sink",
    "sm_scale",
    "attention_chunk_size",
    "q_scale",
    "k_scale",
    "v_scale",
    "update_kv_cache",
    "use_causal_mask",
    "attn_logits_soft_cap",
)
GDN_PARAMETERS = (
    "mixed_qkv",
    "b",
    "a",
    "conv_state",
    "recurrent_state",
    "conv_weight",
    "conv_bias",
    "A_log",
    "dt_bias",
    "state_indices",
    "query_start_loc",
    "distribution",
    "seq_lens",
    "n_kq",
    "n_v",
    "d_k",
    "d_v",
    "kernel_size",
    "mesh",
    "read_state_indices",
)
_METADATA = {
    "rpa": ("kv_lens", "page_indices", "cu_q_lens", "distribution"),
    "gdn": ("state_indices", "query_start_loc", "distribution", "seq_lens", "read_state_indices"),
}
_HEAD_AXES = ("model", "expert", "dcp")
ATTENTION_MODULE = "tpu_inference.layers.common.attention_interface"
GDN_MODULE = "tpu_inference.layers.common.gdn_attention"


class FakeCallError(AssertionError):
  """A call that tpu-inference 0.32.0 would not accept as this package makes it."""


@dataclasses.dataclass
class Call:
  """One recorded call: the function and its arguments by upstream parameter name."""

  function: str
  args: dict[str, Any]


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise FakeCallError(message)


def _bind(function: str, parameters: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
  _check(not kwargs, f"{function}: every argument is passed positionally in 0.32.0's order; got keywords {kwargs}")
  _check(len(args) == len(parameters), f"{function}: expected {len(parameters)} positional arguments, got {len(args)}")
  return dict(zip(parameters, args))


def _check_metadata(function: str, bound: dict[str, Any], names: tuple[str, ...]) -> None:
  for name in names:
    arr = bound[name]
    _check(arr.ndim == 1 and arr.dtype == jnp.int32, f"{function}: {name} must be 1-D int32; got {arr.shape} {arr.dtype}")
  _check(bound["distribution"].shape == (3,), f"{function}: distribution must be (3,)")


def head_shards(mesh: jax.sharding.Mesh) -> int:
  """The upstream head split: the product of the mesh's `model`, `expert` and `dcp` axes (absent ones are 1)."""
  return int(np.prod([mesh.shape[a] for a in _HEAD_AXES if a in mesh.shape]))


class RecordingTpuInference:
  """The two functions, checked and recorded; answered by the reference ops."""

  def __init__(self):
    self.calls: list[Call] = []
    self._reference = ReferenceBackend()

  def sharded_ragged_paged_attention(self, *args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
    """0.32.0's `sharded_ragged_paged_attention(mesh, q, k, v, kv_cache, ...)` -> `(out, kv_cache)`."""
    f = "sharded_ragged_paged_attention"
    bound = _bind(f, RPA_PARAMETERS, args, kwargs)
    q, k, v, cache = bound["q"], bound["k"], bound["v"], bound["kv_cache"]
    _check(isinstance(bound["mesh"], jax.sharding.Mesh), f"{f}: the first argument must be the mesh")
    _check(q.ndim == 3, f"{f}: q must be [T, Hq, d]; got {q.shape}")
    _check(
        k is not None and v is not None and k.shape == v.shape == (q.shape[0], k.shape[1], q.shape[2]),
        f"{f}: k and v must both be arrays [T, Hkv, d] (also for update_kv_cache=False); got {k} / {v}",
    )
    _check(q.shape[1] % k.shape[1] == 0, f"{f}: Hq {q.shape[1]} must be a multiple of Hkv {k.shape[1]}")
    _check(k.dtype == v.dtype == cache.dtype, f"{f}: k, v and the cache must share a dtype; got {k.dtype} {cache.dtype}")
    # Upstream shards the packed-head axis over the head axes and each shard packs its own heads.
    shards = head_shards(bound["mesh"])
    expected = get_kv_cache_shape(cache.shape[0], cache.shape[1], k.shape[1], q.shape[2], cache.dtype, shards)
    _check(cache.shape == expected, f"{f}: cache {cache.shape} does not hold {k.shape[1]} KV heads: {expected}")
    _check_metadata(f, bound, _METADATA["rpa"])
    _check(isinstance(bound["sm_scale"], float), f"{f}: sm_scale must be a float; got {bound['sm_scale']!r}")
    _check(isinstance(bound["update_kv_cache"], bool), f"{f}: update_kv_cache must be a bool")
    sink = bound["attention_sink"]
    _check(sink is None or q.shape[2] == 64, f"{f}: attention sinks are supported for head_dim 64 only")
    _check(bound["update_kv_cache"] or q.shape[2] != 64, f"{f}: update_kv_cache=False is not supported at head_dim 64")
    self.calls.append(Call(f, bound))
    ref_args = [bound[n] for n in RPA_PARAMETERS[1:]]
    return self._reference.ragged_paged_attention(*ref_args, num_kv_heads=k.shape[1], num_kv_shards=shards)

  def run_jax_gdn_attention(self, *args: Any, **kwargs: Any):
    """0.32.0's `run_jax_gdn_attention(mixed_qkv, ..., kernel_size, mesh, read_state_indices)` -> `((conv, rec), out)`."""
    f = "run_jax_gdn_attention"
    bound = _bind(f, GDN_PARAMETERS, args, kwargs)
    n_kq, n_v, d_k, d_v, width = (bound[n] for n in ("n_kq", "n_v", "d_k", "d_v", "kernel_size"))
    _check(all(isinstance(n, int) for n in (n_kq, n_v, d_k, d_v, width)), f"{f}: head counts and sizes are ints")
    _check(isinstance(bound["mesh"], jax.sharding.Mesh), f"{f}: the argument after kernel_size must be the mesh")
    x, conv, rec, weight = (bound[n] for n in ("mixed_qkv", "conv_state", "recurrent_state", "conv_weight"))
    channels = 2 * n_kq * d_k + n_v * d_v
    t = x.shape[0]
    _check(x.shape == (t, channels), f"{f}: mixed_qkv must be [T, {channels}]; got {x.shape}")
    for name in ("b", "a"):
      _check(bound[name].shape == (t, n_v), f"{f}: {name} must be [T, n_v]; got {bound[name].shape}")
    _check(conv.shape[1:] == (width - 1, channels), f"{f}: conv_state must be [M, K-1, C]; got {conv.shape}")
    _check(rec.shape[1:] == (n_v, d_k, d_v) and rec.dtype == jnp.float32, f"{f}: recurrent_state [M, nv, dk, dv] fp32")
    _check(conv.shape[0] == rec.shape[0], f"{f}: both states need the same slot count")
    _check(weight.shape == (channels, 1, width), f"{f}: conv_weight must be [C, 1, K]; got {weight.shape}")
    for name in ("A_log", "dt_bias"):
      _check(bound[name].shape == (n_v,), f"{f}: {name} must be [n_v]; got {bound[name].shape}")
    _check_metadata(f, bound, _METADATA["gdn"])
    self.calls.append(Call(f, bound))
    return self._gdn_per_shard(bound, head_shards(bound["mesh"]))

  def _gdn_per_shard(self, bound: dict[str, Any], shards: int):
    n_kq, n_v = bound["n_kq"] // shards, bound["n_v"] // shards  # heads per shard
    d_k, d_v = bound["d_k"], bound["d_v"]
    c = 2 * n_kq * d_k + n_v * d_v  # channels per shard
    convs, recs, outs = [], [], []
    for s in range(shards):
      ch, hd = slice(s * c, (s + 1) * c), slice(s * n_v, (s + 1) * n_v)
      bias = bound["conv_bias"]
      (conv, rec), out = self._reference.gdn_attention(
          bound["mixed_qkv"][:, ch],
          bound["b"][:, hd],
          bound["a"][:, hd],
          bound["conv_state"][:, :, ch],
          bound["recurrent_state"][:, hd],
          bound["conv_weight"][ch],
          None if bias is None else bias[ch],
          bound["A_log"][hd],
          bound["dt_bias"][hd],
          bound["state_indices"],
          bound["query_start_loc"],
          bound["distribution"],
          bound["seq_lens"],
          n_kq,
          n_v,
          d_k,
          d_v,
          bound["kernel_size"],
          bound["read_state_indices"],
      )
      convs.append(conv)
      recs.append(rec)
      outs.append(out)
    return (jnp.concatenate(convs, axis=2), jnp.concatenate(recs, axis=1)), jnp.concatenate(outs, axis=1)

  def calls_to(self, function: str) -> list[Call]:
    """The recorded calls of one function, in call order."""
    return [c for c in self.calls if c.function == function]

  def modules(self) -> dict[str, types.ModuleType]:
    """`sys.modules` entries exposing the two functions under their tpu-inference module names."""
    attention_name, gdn_name = ATTENTION_MODULE, GDN_MODULE
    attention = types.ModuleType(attention_name)
    attention.sharded_ragged_paged_attention = self.sharded_ragged_paged_attention
    gdn = types.ModuleType(gdn_name)
    gdn.run_jax_gdn_attention = self.run_jax_gdn_attention
    names = ("tpu_inference", "tpu_inference.layers", "tpu_inference.layers.common")
    return {**{n: types.ModuleType(n) for n in names}, attention_name: attention, gdn_name: gdn}
