"""Fixtures of the reference-runner tests: tiny hybrid configs and fake KV-cache specs.

The fake specs have the fields and methods of `maxtext.integration.vllm.kv_cache_spec` (INTERFACES.md), written
here from the contract (runner cache shape `(N, bs, align(2*Hkv, pk)/pk, pk, align(head_dim, 128))`).
"""

import dataclasses
import math

import numpy as np
import pytest

from maxtext.configs import load_config

_ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class FakeAttentionSpec:
  """Attention spec with the interface fields."""

  layer_type: str
  block_size: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  sliding_window: int | None

  def cache_shape(self, num_blocks):
    """Runner layout, rank 5."""
    pk = 4 // _ITEMSIZE[self.dtype]
    packed = -(-2 * self.num_kv_heads // pk)
    return (num_blocks, self.block_size, packed, pk, -(-self.head_dim // 128) * 128)

  def page_size_bytes(self):
    """Bytes of one block."""
    return math.prod(self.cache_shape(1)) * _ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class FakeRecurrentSpec:
  """Recurrent (GDN) spec with the interface fields."""

  conv_shape: tuple
  recurrent_shape: tuple
  conv_dtype: str
  recurrent_dtype: str = "float32"

  def cache_shapes(self, num_slots):
    """(conv shape, recurrent shape) with `num_slots` rows."""
    return (num_slots,) + tuple(self.conv_shape), (num_slots,) + tuple(self.recurrent_shape)

  def slot_size_bytes(self):
    """Bytes of one slot of both arrays."""
    return math.prod(self.conv_shape) * _ITEMSIZE[self.conv_dtype] + math.prod(self.recurrent_shape) * 4


def fake_kv_cache_specs(cfg):
  """("layer.i" -> spec for layers that own a cache, "layer.i" -> "layer.source" for KV-shared layers)."""
  specs, shared = {}, {}
  dtype = cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
  for i, kind in enumerate(cfg.layer_types):
    name = f"layer.{i}"
    if cfg.kv_shared_source[i] >= 0:
      shared[name] = f"layer.{cfg.kv_shared_source[i]}"
    elif kind == "linear_attention":
      conv = (cfg.gdn_conv_kernel_dim - 1, cfg.gdn_conv_dim)
      rec = (cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim)
      specs[name] = FakeRecurrentSpec(conv, rec, cfg.dtype)
    else:
      window = cfg.sliding_window_size if kind == "sliding_attention" else None
      specs[name] = FakeAttentionSpec(kind, cfg.block_size, cfg.base_num_kv_heads, cfg.head_dim, dtype, window)
  return specs, shared


def qwen3_next_config(**overrides):
  """8 layers [lin, lin, lin, full] * 2."""
  values = {"decoder_block": "qwen3_next", "base_num_decoder_layers": 8, "inhomogeneous_layer_cycle_interval": 4}
  values.update(overrides)
  return load_config(**values)


def gemma3_config(**overrides):
  """6 layers [slide, slide, full] * 2, window 8; with num_kv_shared_layers=2 layer 4 reads 3 and layer 5 reads 2."""
  values = {
      "decoder_block": "gemma3",
      "base_num_decoder_layers": 6,
      "inhomogeneous_layer_cycle_interval": 3,
      "sliding_window_size": 8,
  }
  values.update(overrides)
  return load_config(**values)


def llama_config(**overrides):
  """2 full-attention layers."""
  return load_config(**overrides)


@pytest.fixture(name="configs")
def fixture_configs():
  """Factories of the tiny test configs."""
  return {"qwen3_next": qwen3_next_config, "gemma3": gemma3_config, "llama": llama_config}


@pytest.fixture(name="make_specs")
def fixture_make_specs():
  """`make_specs(cfg) -> (specs, shared_layers)` with fake specs."""
  return fake_kv_cache_specs


@pytest.fixture(name="spec_types")
def fixture_spec_types():
  """The fake spec classes (attention, recurrent)."""
  return FakeAttentionSpec, FakeRecurrentSpec


@pytest.fixture(name="np_rng")
def fixture_np_rng():
  """A seeded NumPy generator."""
  return np.random.default_rng(1234)
