"""Every family's runner step with tpu-inference's real kernels, compiled for TPU v6e and v5e slices on this CPU.

`kernel_backend=tpu_inference` calls tpu-inference 0.32.0's `sharded_ragged_paged_attention` (its Pallas RPA v3
kernel) and `run_jax_gdn_attention` (its GDN v3 kernel); here they are traced and compiled by libtpu for real TPU
targets (`tpu_compile.py` says how, and names its two stand-ins). Each family's tiny config runs at TP 1 and 4 (a
`v6e:2x2` slice), as a decode step (16 padded tokens) and a prefill chunk (256), with the runner's physical cache
list, shared arrays and donation. The tiny Gated DeltaNet families use 128-dim heads (the upstream kernel's lane
width; smaller ones are refused by name) and, at TP 4, four key heads so that each shard has one.
"""

from __future__ import annotations

import pytest

import tpu_compile as tc

DECODE = tc.StepShape("decode", 16)
PREFILL = tc.StepShape("prefill", 256)
TPU_GDN = {"gdn_key_head_dim": 128, "gdn_value_head_dim": 128, "gdn_num_key_heads": 4, "gdn_num_value_heads": 8}
# family -> (extra config keys, layers that call a tpu-inference kernel)
FAMILIES = {
    "llama-tiny": ({}, 4),
    "qwen3-tiny": ({}, 4),
    "gemma3-tiny": ({}, 6),  # sliding + full layers, their arrays shared between groups
    "kvshare-tiny": ({}, 6),  # two layers read their sources' caches without writing
    # head_dim 64 (the kernel's hd64 variant), sinks, windows; 8 query heads so that each KV head of a TP-4 shard
    # has a pair of them (the hd64 kernel takes sinks only for whole pairs in bf16; the backend refuses fewer).
    "gpt-oss-tiny": ({"base_num_query_heads": 8}, 4),
    "qwen3-next-tiny": (TPU_GDN, 8),  # Gated DeltaNet states first, then attention
    "qwen3.5-tiny": (TPU_GDN, 8),
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(result: tc.CompiledStep) -> int:
  return sum(n for op, n in result.collectives().items() if op.split("-start")[0] in COLLECTIVES)


@pytest.mark.parametrize("step", [DECODE, PREFILL], ids=lambda s: s.name)
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_compiles_for_v6e_with_the_real_kernels(family, tp, step):
  extra, kernel_layers = FAMILIES[family]
  result = tc.compile_step(family, "v6e", tp, step, extra=extra)
  # The upstream Pallas kernels are in the program, one call or more per layer that attends or recurs.
  assert result.custom_calls.get("tpu_custom_call", 0) >= kernel_layers, result.custom_calls
  # Donated caches come back in place: every cache array of the output reuses its input's buffer.
  assert result.aliased_inputs() == result.num_cache_leaves > 0
  assert result.peak_bytes < tc.CHIPS["v6e"].hbm_bytes
  assert result.flops > 0
  if tp == 1:
    assert _collectives(result) == 0, result.collectives()
    return
  # Tensor parallelism reduces the attention and MLP outputs over the model axis. The only gathers are Gated
  # DeltaNet's: the backend puts the [q | k | v] channels of the activations and the conv weight in the upstream
  # kernel's per-shard order every step (`jnp.take` across shards; docs/serving.md, "Compiled for TPU").
  assert result.collectives().get("all-reduce", 0) > 0
  gathers = result.all_gather_sources()
  if extra is TPU_GDN:
    assert gathers and all(source.endswith(("_take/Arg_0", "_take")) or "/jit(_take)/" in source for source in gathers)
  else:
    assert not gathers, gathers


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_compiles_for_v5e(family):
  extra, kernel_layers = FAMILIES[family]
  result = tc.compile_step(family, "v5e", 4, DECODE, extra=extra)
  assert result.custom_calls.get("tpu_custom_call", 0) >= kernel_layers
  assert result.aliased_inputs() == result.num_cache_leaves
  assert result.peak_bytes < tc.CHIPS["v5e"].hbm_bytes


@pytest.mark.parametrize("family", ["granite4-tiny", "bamba-tiny"])
def test_mamba2_is_refused_by_tpu_inference_and_compiles_on_the_reference_path(family):
  """tpu-inference 0.32.0 has no Mamba2 kernel: the tpu_inference backend says so; the pure-JAX reference backend
  compiles for the TPU (no Pallas kernel in it)."""
  with pytest.raises(NotImplementedError, match="cannot run mamba layers .* use kernel_backend=reference"):
    tc.compile_step(family, "v6e", 1, DECODE)
  result = tc.compile_step(family, "v6e", 1, DECODE, extra={"kernel_backend": "reference"})
  assert "tpu_custom_call" not in result.custom_calls
  assert result.aliased_inputs() == result.num_cache_leaves


@pytest.mark.parametrize("family", ["gemma3-tiny", "qwen3-next-tiny"])
def test_the_remap_adds_no_instruction_to_the_tpu_program(family):
  """The same arrays in tpu-inference's order, in layer order and shuffled: the program handed to XLA has the same
  instructions, so resolving `layer_name_to_kvcache_index` costs nothing on the device."""
  extra, _ = FAMILIES[family]
  results = {
      layout: tc.compile_step(family, "v6e", 1, DECODE, layout=layout, extra=extra)
      for layout in ("hybrid", "layer", "shuffled")
  }
  unoptimized = {layout: tc.hlo_opcodes(r.unoptimized_hlo_text) for layout, r in results.items()}
  assert unoptimized["layer"] == unoptimized["hybrid"] == unoptimized["shuffled"]
  # After XLA's passes the programs do the same work: the same kernels and collectives, whatever the order of the
  # buffers (XLA schedules its asynchronous copies and slices by it).
  kernels = {layout: r.custom_calls.get("tpu_custom_call", 0) for layout, r in results.items()}
  assert len(set(kernels.values())) == 1, kernels
  collectives = {layout: _collectives(r) for layout, r in results.items()}
  assert len(set(collectives.values())) == 1, collectives


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_cache_shapes_are_tpu_inferences_own(kv_heads, head_dim, dtype, tp):
  """This package's attention cache shape under tensor parallelism against tpu-inference's
  `get_kv_cache_shape_with_mesh` on a TPU mesh (heads padded to the TP size first, as its runner does)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from tpu_inference.runner.kv_cache import get_kv_cache_shape_with_mesh  # pylint: disable=import-outside-toplevel

  from maxtext.kv_cache.kv_cache_layout import get_kv_cache_shape, get_padded_num_heads  # pylint: disable=C0415

  tc.install()
  padded = get_padded_num_heads(kv_heads, tp)
  upstream = get_kv_cache_shape_with_mesh(tc.slice_mesh("v6e", 4, tp), 32, 16, padded, head_dim, jnp.dtype(dtype))
  assert get_kv_cache_shape(32, 16, padded, head_dim, dtype, tp) == tuple(upstream)


# llama-tiny as a Hugging Face config, for tpu-inference's own Llama model.
LLAMA_TINY_HF = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "architectures": ["LlamaForCausalLM"],
}


@pytest.mark.parametrize("tp", [1, 4])
def test_tpu_inferences_own_llama_and_this_one_communicate_alike(tp, tmp_path):
  """tpu-inference's JAX Llama and this package's, compiled for the same slice, shapes and sharding: the same
  all-reduces, no gather in either, both with the kernels (docs/serving.md compares the real sizes)."""
  import transformers  # pylint: disable=import-outside-toplevel

  config = transformers.LlamaConfig.from_dict(LLAMA_TINY_HF)
  theirs = tc.compile_upstream_step("llama", config, str(tmp_path), "v6e", tp, DECODE)
  ours = tc.compile_step("llama-tiny", "v6e", tp, DECODE)
  for result in (theirs, ours):
    assert result.custom_calls.get("tpu_custom_call", 0) >= 4
    assert result.aliased_inputs() == result.num_cache_leaves == 4
    assert not result.all_gather_sources()
  assert ours.collectives().get("all-reduce", 0) == theirs.collectives().get("all-reduce", 0)
