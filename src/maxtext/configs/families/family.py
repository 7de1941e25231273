"""The record one model family (one `decoder_block`) declares: everything the rest of the package asks about it.

A family owns its default layer pattern, its trait flags (the `use_*` derived keys the layers read), its config
rule, how a Hugging Face `config.json` of it maps to config keys (model types, the transformers defaults, the
layer types and family keys), which GGUF architecture holds it, and the checkpoint tensor layout its blocks use
(layout names; the layers that own the parameters declare what each one reads). Each family is one module of this
package, registered in `maxtext.configs.families`; nothing else branches on a family's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from maxtext.configs.families.hf_fields import HFFields

# check(values) raises ConfigError naming the key, the value and what must hold for this family.
FamilyCheck = Callable[[Mapping[str, Any]], None]
# layer_types(fields, num_layers) -> the per-layer kinds a Hugging Face config of the family names.
HFLayerTypes = Callable[[HFFields, int], list[str]]
# overrides(fields, layer_types, hidden_size) -> the family's own config keys (GDN, Mamba2, MoE, multipliers, ...).
HFOverrides = Callable[[HFFields, list[str], int], dict[str, Any]]
# config(require, hf_config) -> the Hugging Face config fields a GGUF file of the family leaves to llama.cpp's code;
# require(key) is the value of metadata `{architecture}.{key}` (an error when absent), hf_config the fields mapped so far.
GGUFConfig = Callable[[Callable[[str], Any], Mapping[str, Any]], dict[str, Any]]

# The feed-forward layouts `models/decoder_layer.py` declares (see `TensorLayout.ffn`).
FFN_MLP = "mlp"  # `mlp.` dense MLP, or the routed experts on the config's MoE layers
FFN_FEED_FORWARD = "feed_forward"  # `feed_forward.` dense MLP on every layer (Bamba)
FFN_GRANITE = "granite_shared_mlp"  # `shared_mlp.` fused MLP beside `block_sparse_moe.` experts (Granite 4.0)
FFN_LAYOUTS = (FFN_MLP, FFN_FEED_FORWARD, FFN_GRANITE)
# The gated delta net projection layouts (see `TensorLayout.gdn_projections`).
GDN_FLAT = "flat"  # in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5)
GDN_GROUPED = "grouped"  # in_proj_qkvz / in_proj_ba grouped per key head (Qwen3-Next)
GDN_LAYOUTS = (GDN_FLAT, GDN_GROUPED)


@dataclasses.dataclass(frozen=True)
class Traits:
  """The family's trait flags; `derived.derive` turns each field `x` into the config key `use_x`.

  Attributes:
    qk_norm: RMSNorm on every query and key head before RoPE.
    zero_centered_norm: every RMSNorm scales by `1 + w` (weights stored centred on zero).
    sandwich_norm: norms after attention and after the MLP as well as before them.
    embedding_scale: embeddings multiplied by sqrt(emb_dim).
    attention_output_gate: q_proj also yields a sigmoid gate on the attention output.
    attention_sinks: one learned logit per query head that takes softmax mass and weights no value.
    moe_bias: biased router and experts.
    clamped_swiglu: the experts' clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).
    global_rope_on_sliding: sliding layers use the global RoPE (not `local_rope_max_timescale`).
  """

  qk_norm: bool = False
  zero_centered_norm: bool = False
  sandwich_norm: bool = False
  embedding_scale: bool = False
  attention_output_gate: bool = False
  attention_sinks: bool = False
  moe_bias: bool = False
  clamped_swiglu: bool = False
  global_rope_on_sliding: bool = False


@dataclasses.dataclass(frozen=True)
class HFMapping:
  """How a Hugging Face `config.json` of the family becomes config keys.

  Attributes:
    model_types: text `model_type` -> the defaults of its transformers config class for the fields read (used
      when config.json omits them; `hf_fields.COMMON_DEFAULTS` fill the rest).
    multimodal_types: multimodal wrapper `model_type` -> the `model_type` of its `text_config`.
    layer_types: the per-layer kinds of a config (given or derived as transformers derives them).
    overrides: the family's own keys beyond the shape, norm, RoPE and activation keys every family maps.
    activation_key: the config field naming the MLP activation.
    reads_mlp_bias: whether `mlp_bias` is a field of the family's config (else no MLP has a bias).
    rope_per_layer_type: RoPE parameters are given per layer type (`full_attention`, `sliding_attention`).
  """

  model_types: Mapping[str, Mapping[str, Any]]
  layer_types: HFLayerTypes
  overrides: HFOverrides | None = None
  multimodal_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
  activation_key: str = "hidden_act"
  reads_mlp_bias: bool = False
  rope_per_layer_type: bool = False


@dataclasses.dataclass(frozen=True)
class GGUFMapping:
  """A GGUF architecture holding the family.

  Attributes:
    architecture: `general.architecture` of the file.
    model_type: the Hugging Face `model_type` whose config mapping and tensor layout the file reuses.
    permuted_rope_rows: llama.cpp interleaved the two rotary halves of every q/k head's rows (GPT-J style rope).
    layer_names: GGUF tensor names (after `blk.{i}.`) -> Hugging Face names (after `model.layers.{i}.`) where the
      architecture differs from the shared table (`checkpoint/gguf.py`).
    norm_shift: what llama.cpp's converter added to every tensor whose name ends in `norm.weight` (subtracted on
      load).
    config: the Hugging Face config fields the file does not store, or None.
  """

  architecture: str
  model_type: str
  permuted_rope_rows: bool = False
  layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
  norm_shift: float = 0.0
  config: GGUFConfig | None = None


@dataclasses.dataclass(frozen=True)
class TensorLayout:
  """The checkpoint tensor layout of the family's blocks, named for the layers' parameter declarations.

  Attributes:
    pre_mlp_norm: the Hugging Face name of the norm before the MLP (after `model.layers.{i}.`).
    final_norm: the Hugging Face name of the final norm.
    ffn: one of FFN_LAYOUTS.
    gdn_projections: one of GDN_LAYOUTS (read only by families with linear_attention layers).
  """

  pre_mlp_norm: str = "post_attention_layernorm"
  final_norm: str = "model.norm.weight"
  ffn: str = FFN_MLP
  gdn_projections: str = GDN_FLAT


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: the unit registered under its `decoder_block`.

  Attributes:
    name: the `decoder_block` value.
    cycle_kind: the kind of the layers between full attention layers in the default pattern (layer i is full
      attention when `(i + 1) % inhomogeneous_layer_cycle_interval == 0`), or None for full attention everywhere.
    owned_kinds: layer kinds only this family's blocks implement; a config of another family may not name them.
    traits: the trait flags.
    hf: the Hugging Face config mapping.
    tensors: the checkpoint tensor layout.
    gguf: the GGUF architectures holding the family.
    check: the family's config rule, or None.
  """

  name: str
  hf: HFMapping
  cycle_kind: str | None = None
  owned_kinds: tuple[str, ...] = ()
  traits: Traits = Traits()
  tensors: TensorLayout = TensorLayout()
  gguf: tuple[GGUFMapping, ...] = ()
  check: FamilyCheck | None = None

  def __post_init__(self):
    if self.tensors.ffn not in FFN_LAYOUTS:
      raise ValueError(f"family {self.name!r}: tensors.ffn must be one of {FFN_LAYOUTS}, got {self.tensors.ffn!r}")
    if self.tensors.gdn_projections not in GDN_LAYOUTS:
      raise ValueError(
          f"family {self.name!r}: tensors.gdn_projections must be one of {GDN_LAYOUTS}, got"
          f" {self.tensors.gdn_projections!r}"
      )
    if not self.hf.model_types:
      raise ValueError(f"family {self.name!r}: hf.model_types must name at least one Hugging Face model_type")
