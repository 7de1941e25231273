"""Tensor- and expert-parallel decodes on the fake 8-device CPU mesh give the single-device greedy tokens."""

import jax
import pytest

from support import kv_cache_checks
from maxtext.configs import ConfigError
from maxtext.inference import LLM, SamplingParams

PROMPTS = [[5, 9, 33, 71, 12, 8, 90, 14, 3, 60, 61], [44, 3, 101]]
# One token bucket (min_token_bucket = the budget): one compiled step per mesh.
RUN = {
    "max_num_seqs": 2,
    "num_kv_blocks": 48,
    "block_size": 8,
    "max_num_batched_tokens": 16,
    "min_token_bucket": 16,
    "max_target_length": 64,
}
MESHES = {
    "llama-tiny": [{"ici_tensor_parallelism": 2}, {"ici_tensor_parallelism": 4}],
    "qwen3-tiny": [{"ici_tensor_parallelism": 2}, {"ici_tensor_parallelism": 4}],
    "gemma3-tiny": [{"ici_tensor_parallelism": 2}, {"ici_tensor_parallelism": 4}],
    "kvshare-tiny": [{"ici_tensor_parallelism": 2}],
    "qwen3-next-tiny": [{"ici_tensor_parallelism": 2}, {"ici_tensor_parallelism": 2, "ici_expert_parallelism": 2}],
    "qwen3.5-tiny": [{"ici_tensor_parallelism": 2}, {"ici_tensor_parallelism": 4}],
    # gpt-oss-tiny's caches pack its KV heads into 2, which the runner shards over tensor x expert: one axis each.
    "gpt-oss-tiny": [{"ici_tensor_parallelism": 2}, {"ici_expert_parallelism": 2}],
}


def _tokens(name, **mesh):
  llm = LLM(model_name=name, **RUN, **mesh)
  outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))
  assert kv_cache_checks.all_free(llm.engine.manager)
  return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_parallel_decodes_match_the_single_device_tokens(name):
  single, _ = _tokens(name)
  for mesh in MESHES[name]:
    tokens, llm = _tokens(name, **mesh)
    assert tokens == single, mesh
    assert llm.engine.mesh.size == jax.numpy.prod(jax.numpy.asarray(list(mesh.values())))
    assert llm.engine.model.is_sharded


def test_a_mesh_that_does_not_divide_the_heads_names_the_key():
  with pytest.raises(ConfigError, match=r"ici_tensor_parallelism=3: base_num_kv_heads=2 cannot be sharded"):
    LLM(model_name="qwen3-tiny", ici_tensor_parallelism=3)
  with pytest.raises(ConfigError, match=r"ici_tensor_parallelism=8: the runner replicates base_num_kv_heads=2 to 8"):
    LLM(model_name="qwen3-tiny", ici_tensor_parallelism=8)


@pytest.mark.slow
def test_a_cache_laid_out_per_shard_decodes_like_one_device():
  """gpt-oss-tiny's head-dim-64 cache in bfloat16 over 2 shards: one head per shard, each padded to a pair of rows
  (2 rows where one device packs both heads in one), as the runner allocates it; the tokens stay the same."""
  dtype = {"kv_cache_dtype": "bfloat16"}
  single, one = _tokens("gpt-oss-tiny", **dtype)
  sharded, two = _tokens("gpt-oss-tiny", ici_tensor_parallelism=2, **dtype)
  assert one.engine.manager.cache_shapes()[0].shape[2:] == (1, 2, 128)
  assert two.engine.manager.cache_shapes()[0].shape[2:] == (2, 2, 128)
  assert sharded == single
