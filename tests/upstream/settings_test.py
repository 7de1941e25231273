"""The real runner in the settings a server uses: KV sharing, prefix caching on a hybrid model (vLLM's align mode),
tensor parallelism 2 on two CPU devices; and the two defects the first real run showed, each on its own."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import cases


def test_kv_sharing_layers_read_their_sources_slot(references, run_vllm):
  """Gemma3 whose layers 4 and 5 read the K/V of layers 3 and 2 (stated through the spec patch's
  `shared_kv_cache_layers`): the runner maps them to their sources' arrays and allocates none for them."""
  reference = references["gemma3_kv_sharing"]
  result = run_vllm(reference["folder"], patched=True, maxtext_config=cases.KV_SHARING["maxtext_config"])
  assert result["tokens"] == reference["maxtext"]
  slots = result["layout"]["layer_name_to_kvcache_index"]
  assert slots["layer.4"] == slots["layer.3"] and slots["layer.5"] == slots["layer.2"]
  assert not {"layer.4", "layer.5"} & {name for g in result["layout"]["groups"] for name in g["layers"]}


def test_prefix_caching_on_a_hybrid_model_hits_and_decodes_right(references, run_vllm):
  """Qwen3-Next MoE with --enable-prefix-caching: the plugin's config hook puts vLLM in the align mode, the later
  requests find the first one's 48-token prefix (states included), and every request decodes as transformers."""
  reference = references["prefix_caching"]
  result = run_vllm(
      reference["folder"],
      patched=True,
      engine={"enable_prefix_caching": True},
      prompts=(),
      rounds=cases.PREFIX_ROUNDS,
  )
  assert result["num_cached_tokens"] == [0, len(cases.PREFIX), len(cases.PREFIX)]
  assert result["tokens"] == reference["transformers"] == reference["maxtext"]
  assert "Mamba cache mode is set to 'align' for MaxTextForCausalLM" in result["log"]


@pytest.mark.parametrize("case", ["qwen3", "qwen3_next_moe"])
def test_tensor_parallelism_2_on_the_runners_mesh(case, references, run_vllm):
  """tensor_parallel_size=2 over two CPU devices: the runner's mesh is ('data', 'model') with no expert axis."""
  _, patched = cases.FAMILIES[case]
  reference = references[case]
  result = run_vllm(reference["folder"], patched=patched, engine={"tensor_parallel_size": 2}, devices=2)
  assert result["layout"]["mesh"] == {"data": 1, "model": 2}
  assert result["tokens"] == reference["transformers"]


def _runner_metadata(num_tokens: int = 4, num_reqs: int = 2):
  from tpu_inference.layers.common import attention_metadata  # pylint: disable=import-outside-toplevel

  return attention_metadata.AttentionMetadata(
      input_positions=jax.numpy.arange(num_tokens, dtype=np.int32),
      block_tables=jax.numpy.zeros(num_reqs * 4, np.int32),
      seq_lens=jax.numpy.asarray([num_tokens] + [0] * (num_reqs - 1), np.int32),
      query_start_loc=jax.numpy.asarray([0] + [num_tokens] * num_reqs, np.int32),
      request_distribution=jax.numpy.asarray([0, 0, 1], np.int32),
      padded_num_reqs=num_reqs,
  )


def test_tpu_inferences_own_metadata_and_grouping_reach_every_layer_through_jit():
  """Defect 1: tpu-inference's AttentionMetadata class (not this package's) in its GroupedAttentionMetadata, through
  a jit boundary: every layer gets its group's metadata, layers of one group the same object."""
  # pylint: disable=import-outside-toplevel
  from tpu_inference.layers.common.attention_metadata import GroupedAttentionMetadata

  from maxtext.kernels.attention_metadata import AttentionMetadata, metadata_for_layers

  grouped = GroupedAttentionMetadata((_runner_metadata(), _runner_metadata(6)), (("layer.0", "layer.2"), ("layer.1",)))
  seen = []

  @jax.jit
  def step(md):
    layers = metadata_for_layers(md, ["layer.0", "layer.1", "layer.2"])
    seen.append(layers)
    return [m.input_positions.sum() for m in layers]

  assert [int(x) for x in step(grouped)] == [6, 15, 6]
  layers = seen[0]
  assert all(isinstance(m, AttentionMetadata) for m in layers)
  assert layers[0] is layers[2] and layers[1] is not layers[0]
  non_causal = _runner_metadata()
  non_causal.use_causal_mask = False
  with pytest.raises(NotImplementedError, match="use_causal_mask is False"):
    metadata_for_layers(non_causal, ["layer.0"])


def test_the_runners_two_axis_mesh_shards_every_parameter():
  """Defect 2: the runner's default mesh (`runner/tpu_runner.py::_create_2d_mesh`) has the axes
  `layers/common/sharding.py::MESH_AXIS_NAMES_2D` names, and no `expert` axis."""
  # pylint: disable=import-outside-toplevel
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES_2D

  from maxtext.configs import load_config
  from maxtext.models import sharding

  axes = MESH_AXIS_NAMES_2D
  assert "expert" not in axes
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), axes)
  cfg = load_config(model_name="qwen3-next-tiny")
  shardings = sharding.param_shardings(cfg, mesh)
  assert set(shardings) and all(s.mesh is mesh for s in shardings.values())
