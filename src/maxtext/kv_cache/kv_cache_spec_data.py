"""The model's per-layer cache needs as plain data in the runner's vocabulary, for a runner that asks for them.

tpu-inference 0.32.0 gives every layer of a JAX model a full-attention spec; with
docs/tpu-inference-kv-cache-spec.patch it asks the model (`MaxTextForCausalLM.get_kv_cache_spec_data()`) instead
and builds vLLM's spec classes from this data (so nothing here imports vLLM):

    {"layers": {"layer.0": {"kind": "mamba", "mamba_type": "GDN_ATTN",
                            "shapes": ((K - 1, conv_dim), (nv, dk, dv)), "dtypes": ("bfloat16", "float32")},
                "layer.3": {"kind": "full_attention" | "sliding_window", "num_kv_heads": Hkv, "head_size": d,
                            "sliding_window": None | W, "dtype": "bfloat16"}},
     "shared_kv_cache_layers": {"layer.5": "layer.3"}}

`kind` values are vLLM's spec kinds; `mamba_type` names vLLM's mamba backend enum member (`GDN_ATTN` for Gated
DeltaNet, `MAMBA2` for Mamba2 layers).
Attention heads and head size are the model's own: the runner pads KV heads up to its tensor-parallel size and the
head size to its lane width, as it does for every JAX model. Mamba shapes are per slot and global (the runner
shards conv channels and recurrent heads itself). KV-sharing layers have no entry in `layers`; they read the cache
of the layer `shared_kv_cache_layers` names.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from maxtext.configs.layer_kinds import LINEAR_ATTENTION, MAMBA
from maxtext.kv_cache import kv_cache_spec

FULL_ATTENTION_KIND = "full_attention"
SLIDING_WINDOW_KIND = "sliding_window"
MAMBA_KIND = "mamba"
GDN_MAMBA_TYPE = "GDN_ATTN"
MAMBA2_MAMBA_TYPE = "MAMBA2"


# vLLM's mamba backend (its MambaAttentionBackendEnum member name) for each recurrent layer kind. The runner only
# sizes and allocates the state arrays from the spec; which backend is named matters to vLLM's bookkeeping, not to
# this model's kernels.
MAMBA_TYPES = {LINEAR_ATTENTION: GDN_MAMBA_TYPE, MAMBA: MAMBA2_MAMBA_TYPE}


def _layer_data(cfg: ml_collections.FrozenConfigDict, name: str, spec: kv_cache_spec.KVCacheSpec) -> dict[str, Any]:
  if isinstance(spec, kv_cache_spec.RecurrentSpec):
    if spec.layer_type not in MAMBA_TYPES:
      raise NotImplementedError(
          f"{name} is a {spec.layer_type} layer, which has no vLLM mamba backend to state it with (known:"
          f" {', '.join(sorted(MAMBA_TYPES))})"
      )
    return {
        "kind": MAMBA_KIND,
        "mamba_type": MAMBA_TYPES[spec.layer_type],
        "shapes": tuple(tuple(shape) for shape in spec.state_shapes),
        "dtypes": tuple(spec.state_dtypes),
    }
  return {
      "kind": FULL_ATTENTION_KIND if spec.sliding_window is None else SLIDING_WINDOW_KIND,
      "num_kv_heads": int(cfg.base_num_kv_heads),
      "head_size": int(spec.head_dim),
      "sliding_window": spec.sliding_window,
      "dtype": spec.dtype,
  }


def kv_cache_spec_data(cfg: ml_collections.FrozenConfigDict) -> dict[str, dict[str, Any]]:
  """The runner-facing specs of every layer of `cfg` (see the module docstring for the format).

  Returns:
    `{"layers": {"layer.<i>": {...}}, "shared_kv_cache_layers": {"layer.<i>": "layer.<source>"}}`, layers in
    layer order.

  Raises:
    NotImplementedError: a recurrent layer kind with no vLLM mamba backend known here.
  """
  specs = kv_cache_spec.get_kv_cache_specs(cfg)
  return {
      "layers": {name: _layer_data(cfg, name, spec) for name, spec in specs.items()},
      "shared_kv_cache_layers": dict(kv_cache_spec.get_shared_kv_cache_layers(cfg)),
  }
