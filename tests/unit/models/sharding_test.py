"""Sharding on the fake 8-device CPU mesh: logical axes, rules, sharded creation, cache shardings, real sizes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from support.param_checks import param_count, params_are_sharded_as_configured
from maxtext.configs import ConfigError, load_config
from maxtext.inference import LLM, SamplingParams
from maxtext.kv_cache import kv_cache_spec
from maxtext.models import Transformer, flat_param_shapes, get_flat_params, sharding

TINY = ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "kvshare-tiny", "qwen3-next-tiny", "qwen3.5-tiny", "gpt-oss-tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY + ["llama3.1-8b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "gemma3-4b"])
def test_every_parameter_has_declared_logical_axes_of_its_rank(name):
  cfg = load_config(model_name=name)
  declared = sharding.declared_axes(cfg)
  shapes = flat_param_shapes(cfg)
  assert set(declared) == set(shapes)
  for param, leaf in shapes.items():
    assert len(sharding.param_logical_axes(param, len(leaf.shape), declared)) == len(leaf.shape)


def test_undeclared_parameters_and_rank_mismatches_are_named():
  declared = sharding.declared_axes(load_config(model_name="llama-tiny"))
  with pytest.raises(ValueError, match=r"parameter 'layers.0.foo.kernel' has no declaration"):
    sharding.param_logical_axes("layers.0.foo.kernel", 2, declared)
  with pytest.raises(ValueError, match=r"parameter 'lm_head.kernel' has rank 3 but its declared logical axes are"):
    sharding.param_logical_axes("lm_head.kernel", 3, declared)


def test_mesh_from_the_parallelism_keys():
  cfg = load_config(ici_data_parallelism=2, ici_tensor_parallelism=2, ici_expert_parallelism=2)
  mesh = sharding.make_mesh(cfg)
  assert dict(mesh.shape) == {"data": 2, "model": 2, "expert": 2}
  with pytest.raises(ValueError, match=r"ici_data_parallelism=2 x ici_tensor_parallelism=8 needs 16 devices"):
    sharding.make_mesh(load_config(ici_data_parallelism=2, ici_tensor_parallelism=8))


def test_rules_map_logical_axes_and_check_divisibility():
  cfg = load_config(model_name="qwen3-tiny", ici_tensor_parallelism=4)
  mesh = sharding.make_mesh(cfg)
  shardings = sharding.param_shardings(cfg, mesh)
  assert shardings["layers.0.attn.q.kernel"].spec == P(None, "model", None)
  assert shardings["layers.0.attn.o.kernel"].spec == P("model", None, None)
  assert shardings["layers.0.mlp.down.kernel"].spec == P("model", None)
  # qwen3-tiny has 2 KV heads: below the tensor-parallel size they are replicated, as the runner does.
  assert shardings["layers.0.attn.k.kernel"].spec == P(None, None, None)
  assert shardings["final_norm.scale"].spec == P(None)
  odd = load_config(base_mlp_dim=130, ici_tensor_parallelism=4)
  with pytest.raises(
      ConfigError, match=r"ici_tensor_parallelism=4: layers.0.mlp.\w+.kernel has 130 along its 'mlp' axis"
  ):
    sharding.param_shardings(odd, mesh)
  with pytest.raises(ConfigError, match=r"ici_tensor_parallelism=8: the runner replicates base_num_kv_heads=2 to 8"):
    sharding.param_shardings(load_config(model_name="qwen3-tiny", ici_tensor_parallelism=8), mesh_of(8))
  replicated = load_config(model_name="qwen3-tiny", ici_tensor_parallelism=4, logical_axis_rules=[["vocab", None]])
  assert sharding.param_shardings(replicated, mesh)["layers.0.attn.q.kernel"].spec == P(None, None, None)


def mesh_of(tp, ep=1):
  """A (data 1, model tp, expert ep) mesh."""
  return sharding.make_mesh(load_config(ici_tensor_parallelism=tp, ici_expert_parallelism=ep))


@pytest.mark.parametrize(
    "rules, match",
    [
        ([["heads"]], r"each entry must be \[logical axis, mesh axis"),
        ([["heads", "tensor"]], r"mesh axes must be among data, model, expert"),
        ([["heads", "model"], ["heads", None]], r"logical axis 'heads' has two rules"),
        ([[3, "model"]], r"each entry must be"),
    ],
)
def test_bad_axis_rules_name_the_key(rules, match):
  with pytest.raises(ConfigError, match=r"logical_axis_rules=.*" + match):
    load_config(logical_axis_rules=rules)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, ep", [("qwen3-tiny", 4, 1), ("qwen3-next-tiny", 2, 2), ("gemma3-tiny", 2, 1)])
def test_sharded_creation_gives_the_unsharded_values_in_their_shardings(name, tp, ep):
  cfg = load_config(model_name=name, ici_tensor_parallelism=tp, ici_expert_parallelism=ep)
  mesh = sharding.make_mesh(cfg)
  model = sharding.create_sharded_model(cfg, mesh, jax.random.key(3))
  assert params_are_sharded_as_configured(model, cfg, mesh)
  reference = get_flat_params(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(3))))
  for param, value in get_flat_params(model).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[param]), err_msg=param)
  expert = get_flat_params(model).get("layers.3.moe.gate")
  if expert is not None:
    assert expert.sharding.spec == P("expert", None, "model")
  placed = sharding.shard_model(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(3))), cfg, mesh)
  assert params_are_sharded_as_configured(placed, cfg, mesh)


def test_cache_shardings_follow_the_runner():
  cfg = load_config(model_name="qwen3-next-tiny", ici_tensor_parallelism=2)
  mesh = sharding.make_mesh(cfg)
  attention = kv_cache_spec.get_layer_spec(cfg, 3)
  recurrent = kv_cache_spec.get_layer_spec(cfg, 0)
  assert sharding.cache_sharding(attention, attention.cache_shape(8), mesh, "kv_caches[6]").spec == P(None, None, "model")
  conv, rec = recurrent.cache_shapes(9)
  assert sharding.cache_sharding(recurrent, conv, mesh, "x").spec == P(None, None, "model")
  assert sharding.cache_sharding(recurrent, rec, mesh, "x").spec == P(None, "model", None, None)
  data_mesh = sharding.make_mesh(load_config(ici_data_parallelism=2, ici_tensor_parallelism=2))
  assert sharding.cache_sharding(recurrent, rec, data_mesh, "x").spec == P("data", "model", None, None)
  with pytest.raises(ConfigError, match=r"ici_tensor_parallelism=8: kv_caches\[1\] has 4 packed KV heads"):
    sharding.cache_sharding(attention, (8, 16, 4, 1, 128), mesh_of(8), "kv_caches[1]")
  expert_mesh = sharding.make_mesh(
      load_config(model_name="qwen3-next-tiny", ici_tensor_parallelism=2, ici_expert_parallelism=2)
  )
  with pytest.raises(
      ConfigError,
      match=r"ici_tensor_parallelism=2 x ici_expert_parallelism=2 \(the runner shards cache heads over both\): "
      r"kv_caches\[0\] has 2 packed KV heads, which must be divisible by 4",
  ):
    sharding.cache_sharding(attention, (8, 16, 2, 1, 128), expert_mesh, "kv_caches[0]")


def _norm_bytes(cfg):
  shapes = flat_param_shapes(cfg)
  return sum(math.prod(s.shape) * s.dtype.itemsize for n, s in shapes.items() if n.endswith("norm.scale"))


@pytest.mark.slow
def test_real_size_parameters_per_chip_under_eval_shape():
  # Llama 3.1 8B, bf16, tensor parallel 8: every matrix splits 8 ways (8 KV heads, 32 query heads, vocab 128256,
  # MLP 14336); only the norm scales are replicated.
  cfg = load_config(model_name="llama3.1-8b", weight_dtype="bfloat16", ici_tensor_parallelism=8)
  per_chip = sharding.per_device_param_bytes(cfg, mesh_of(8))
  norms = _norm_bytes(cfg)
  assert per_chip == (param_count(cfg) * 2 - norms) // 8 + norms
  # Qwen3-Next-80B-A3B on (model 4, expert 2): about an eighth of 80B parameters plus the replicated parts.
  big = load_config(
      model_name="qwen3-next-80b-a3b", weight_dtype="bfloat16", ici_tensor_parallelism=4, ici_expert_parallelism=2
  )
  per_chip = sharding.per_device_param_bytes(big, mesh_of(4, 2))
  total = param_count(big) * 2
  assert total / 8 < per_chip < total / 6


@pytest.mark.slow
def test_sharded_engine_caches_keep_their_shardings_through_steps():
  llm = LLM(model_name="qwen3.5-tiny", ici_tensor_parallelism=2, max_num_seqs=2, num_kv_blocks=32)
  before = jax.tree_util.tree_leaves(llm.engine.kv_caches)
  llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))
  after = jax.tree_util.tree_leaves(llm.engine.kv_caches)
  assert len(after) == len(before)
  for new, old in zip(after, before):
    assert new.sharding.is_equivalent_to(old.sharding, old.ndim), (new.sharding, old.sharding)
  assert any(a.sharding.spec == P(None, None, "model") for a in after)
  assert isinstance(llm.engine.kv_caches[0], tuple) and jnp.issubdtype(llm.engine.kv_caches[0][1].dtype, jnp.floating)


@pytest.mark.slow
def test_a_runner_mesh_without_the_expert_axis_shards_as_if_it_had_size_1():
  """tpu-inference's default mesh is `('data', 'model')` (`runner/tpu_runner.py::_create_2d_mesh`): no `expert`."""
  cfg = load_config(model_name="qwen3-next-tiny", ici_tensor_parallelism=2)
  runner_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
  ours = sharding.make_mesh(cfg)
  theirs = sharding.param_shardings(cfg, runner_mesh)
  for name, expected in sharding.param_shardings(cfg, ours).items():
    assert theirs[name].spec == expected.spec, name
  attention = kv_cache_spec.get_layer_spec(cfg, 3)
  recurrent = kv_cache_spec.get_layer_spec(cfg, 0)
  assert sharding.cache_sharding(attention, attention.cache_shape(8), runner_mesh, "x").spec == P(None, None, "model")
  assert sharding.cache_sharding(recurrent, recurrent.cache_shapes(9)[1], runner_mesh, "x").spec == P(
      None, "model", None, None
  )
  model = sharding.create_sharded_model(cfg, runner_mesh, jax.random.key(3))
  assert params_are_sharded_as_configured(model, cfg, runner_mesh)
