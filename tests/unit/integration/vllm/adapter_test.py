"""MaxTextForCausalLM under the runner's contract: positional call in jit, donated caches, static map."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.fake_vllm_config import FakeVllmConfig, fake_vllm_config
from support.hlo import count_hlo_instructions, count_jaxpr_equations
from maxtext.configs import ConfigError, load_config
from maxtext.kv_cache import kv_cache_spec
from maxtext.integration.vllm.adapter import MaxTextForCausalLM, maxtext_config_from_vllm
from maxtext.kernels.attention_metadata import AttentionMetadata, GroupedAttentionMetadata

MAX_REQS = 8
NUM_BLOCKS = 8


def _model(name="qwen3.5-tiny", **overrides):
  cfg = load_config(model_name=name, block_size=4, **overrides)
  return MaxTextForCausalLM.from_config(cfg, jax.random.key(0), None)


def _hybrid_layout(cfg):
  """Recurrent slots first, then attention slots (tpu-inference's order); returns (caches, map)."""
  kinds = cfg.layer_types
  order = [i for i, k in enumerate(kinds) if k == "linear_attention"] + [
      i for i, k in enumerate(kinds) if k != "linear_attention"
  ]
  caches, pairs = [], []
  for slot, layer in enumerate(order):
    spec = kv_cache_spec.get_layer_spec(cfg, layer)
    if isinstance(spec, kv_cache_spec.RecurrentSpec):
      conv, rec = spec.cache_shapes(MAX_REQS + 1)
      caches.append((jnp.zeros(conv, spec.state_dtypes[0]), jnp.zeros(rec, "float32")))
    else:
      caches.append(jnp.zeros(spec.cache_shape(NUM_BLOCKS), spec.dtype))
    pairs.append((f"layer.{layer}", slot))
  return caches, tuple(sorted(pairs, key=lambda p: int(p[0].split(".")[1])))


def _metadata(cfg, tokens):
  t = len(tokens)
  md = AttentionMetadata(
      input_positions=jnp.arange(t, dtype=jnp.int32),
      block_tables=jnp.asarray(np.arange(1, 1 + MAX_REQS * NUM_BLOCKS) % NUM_BLOCKS, jnp.int32),
      seq_lens=jnp.asarray([t] + [0] * (MAX_REQS - 1), jnp.int32),
      query_start_loc=jnp.asarray([0] + [t] * MAX_REQS, jnp.int32),
      request_distribution=jnp.asarray([0, 0, 1], jnp.int32),
      mamba_state_indices=jnp.asarray([1] + [0] * (MAX_REQS - 1), jnp.int32),
      padded_num_reqs=MAX_REQS,
  )
  names = [f"layer.{i}" for i in range(cfg.base_num_decoder_layers)]
  return GroupedAttentionMetadata([md], [names])


def _runner_step(model):
  """The runner's jit: state leaves first, kv_caches donated, the map (and the rank flags) static."""
  graphdef, state = nnx.split(model)
  traces = []

  def run(state, kv_caches, input_ids, md, inputs_embeds, positions, layer_map, lora, inter, first, last):
    traces.append(layer_map)
    m = nnx.merge(graphdef, state)
    return m(kv_caches, input_ids, md, inputs_embeds, positions, layer_map, lora, inter, first, last)

  jitted = jax.jit(run, donate_argnums=1, static_argnums=(6, 9, 10))

  def call(kv_caches, input_ids, md, layer_map, inputs_embeds=None):
    return jitted(
        state, kv_caches, input_ids, md, inputs_embeds, md.groups[0].input_positions, layer_map, None, None, True, True
    )

  return call, traces


@pytest.mark.slow
def test_runner_call_returns_the_contract_tuple_and_matches_the_dense_forward():
  model = _model()
  cfg = model.cfg
  caches, layer_map = _hybrid_layout(cfg)
  tokens = jnp.asarray([5, 9, 200, 17, 3, 44, 81], jnp.int32)
  call, _ = _runner_step(model)
  new_caches, hidden, aux, experts = call(caches, tokens, _metadata(cfg, tokens), layer_map)
  assert aux == [] and experts is None
  assert hidden.shape == (7, cfg.base_emb_dim) and len(new_caches) == len(caches)
  for old, new in zip(caches, new_caches):
    assert jax.tree_util.tree_structure(old) == jax.tree_util.tree_structure(new)
  logits = model.compute_logits(hidden)
  dense = model.model(tokens[None], gdn_chunked=False)[0]
  # Default-init hybrids amplify fp32 rounding to ~1e-4 (see tests/unit/models/paged_test.py, which checks the
  # paged path at 1e-4 on well-conditioned weights); here the point is the wiring, which a wrong slot breaks by O(1).
  np.testing.assert_allclose(np.asarray(logits), np.asarray(dense), atol=1e-3, rtol=0)
  # Donated: the runner's buffers were consumed by the step.
  assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(caches))


@pytest.mark.slow
def test_same_map_compiles_once_and_a_reordered_map_retraces():
  model = _model()
  cfg = model.cfg
  caches, layer_map = _hybrid_layout(cfg)
  tokens = jnp.asarray([5, 9, 200], jnp.int32)
  call, traces = _runner_step(model)
  call(caches, tokens, _metadata(cfg, tokens), layer_map)
  call(_hybrid_layout(cfg)[0], tokens, _metadata(cfg, tokens), layer_map)
  assert len(traces) == 1
  # Same slots, listed in another order: a different static value, so a new trace, same results.
  call(_hybrid_layout(cfg)[0], tokens, _metadata(cfg, tokens), tuple(reversed(layer_map)))
  assert len(traces) == 2


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda m: m[:-1], ValueError, r"1 of 8 layers are missing: layer\.7"),
        (lambda m: m[:3] + m[4:], ValueError, r"layers are missing: layer\.3"),
        (lambda m: (("layer.0", 99),) + m[1:], ValueError, r"kv_caches index of layer\.0 must be in \[0, 8\)"),
        (
            lambda m: tuple((n, 0) if n == "layer.3" else (n, s) for n, s in m),
            ValueError,
            r"layer\.3 is a full_attention layer and needs a paged KV cache .* but kv_caches\[0\] holds a recurrent"
            r" state",
        ),
        (
            lambda m: tuple((n, 7) if n == "layer.0" else (n, s) for n, s in m),
            ValueError,
            r"layer\.0 is a linear_attention layer and needs a recurrent state .* but kv_caches\[7\] holds an array",
        ),
    ],
)
def test_wrong_maps_fail_clearly_inside_jit(mutate, error, message):
  model = _model()
  cfg = model.cfg
  caches, layer_map = _hybrid_layout(cfg)
  tokens = jnp.asarray([5, 9], jnp.int32)
  call, _ = _runner_step(model)
  with pytest.raises(error, match=message):
    call(caches, tokens, _metadata(cfg, tokens), mutate(layer_map))


@pytest.mark.slow
def test_input_checks():
  model = _model("llama-tiny")
  cfg = model.cfg
  caches, layer_map = _hybrid_layout(cfg)
  tokens = jnp.asarray([5, 9, 4], jnp.int32)
  md = _metadata(cfg, tokens)
  with pytest.raises(ValueError, match="layer_name_to_kvcache_index is required"):
    model(caches, tokens, md)
  with pytest.raises(ValueError, match=r"input_positions has shape \(4,\) but attention_metadata.input_positions"):
    model(caches, tokens, md, None, jnp.arange(4), layer_map)
  with pytest.raises(ValueError, match="one of input_ids"):
    model(caches, None, md, None, None, layer_map)
  with pytest.raises(ValueError, match=r"positions cover 3 tokens but the batch has 2 tokens"):
    model(caches, tokens[:2], md, None, None, layer_map)
  # inputs_embeds replace input_ids; unknown runner keywords are accepted and ignored.
  _, from_ids, _, _ = model(_hybrid_layout(cfg)[0], tokens, md, None, None, layer_map, spec_step_idx=0)
  embeds = model.embed_input_ids(tokens)
  _, from_embeds, _, _ = model(_hybrid_layout(cfg)[0], None, md, embeds, None, layer_map)
  np.testing.assert_allclose(np.asarray(from_ids), np.asarray(from_embeds), atol=1e-6)
  assert model.get_input_embeddings().shape == (cfg.vocab_size, cfg.base_emb_dim)


def test_config_from_vllm_config_attributes():
  vllm = fake_vllm_config({"model_name": "llama-tiny"}, block_size=8)
  vllm = dataclasses.replace(vllm, cache_config=dataclasses.replace(vllm.cache_config, cache_dtype="bfloat16"))
  cfg = maxtext_config_from_vllm(vllm)
  assert cfg.block_size == 8 and cfg.kv_cache_dtype == "bfloat16" and cfg.model_name == "llama-tiny"
  # Keys given in maxtext_config win over the cache config.
  assert maxtext_config_from_vllm(fake_vllm_config({"block_size": 32}, block_size=8)).block_size == 32
  assert maxtext_config_from_vllm(object()).model_name == "default"  # nothing set: base.yml defaults
  with pytest.raises(TypeError, match="additional_config must be a mapping"):
    maxtext_config_from_vllm(FakeVllmConfig(additional_config=[1]))
  with pytest.raises(TypeError, match=r"additional_config\['maxtext_config'\] must be a mapping"):
    maxtext_config_from_vllm(FakeVllmConfig(additional_config={"maxtext_config": "x"}))
  with pytest.raises(ConfigError, match="unknown config key 'nope'"):
    maxtext_config_from_vllm(fake_vllm_config({"nope": 1}))
  dummy = fake_vllm_config({"model_name": "llama-tiny", "load_parameters_path": "/x"}, load_format="dummy")
  assert maxtext_config_from_vllm(dummy).load_parameters_path == ""


# The keys that only steer a maxtext-decode run, written out here rather than taken from the module under test.
CLI_ONLY = (
    "prompt",
    "prompt_token_ids",
    "prompts_file",
    "use_chat_template",
    "max_new_tokens",
    "decode_sampling_temperature",
    "decode_sampling_top_k",
    "decode_sampling_nucleus_p",
    "seed",
    "logprobs",
    "output_format",
    "dry_run",
)
RUNNER_ONLY = (
    "compilation_cache_dir",
    "background_compile",
    "overlap_decode_steps",
    "huge_page_weights",
    "cpu_weight_panels",
    "memory_check",
    "weight_cache",
    "weight_cache_max_bytes",
)


def test_the_config_the_adapter_builds_carries_no_run_option():
  # Both ways of building the model: from a vLLM config, and from the CLI's config (every key set away from its
  # default, so a key that leaked through would show its value).
  from_vllm = maxtext_config_from_vllm(fake_vllm_config({"model_name": "llama-tiny"}))
  cli = load_config(
      model_name="llama-tiny",
      prompt="hi",
      max_new_tokens=3,
      decode_sampling_temperature=0.5,
      output_format="json",
      seed=7,
      cpu_weight_panels=False,
      compilation_cache_dir="",
  )
  from_cli = MaxTextForCausalLM.from_config(cli, jax.random.key(0), None).cfg
  for cfg in (from_vllm, from_cli):
    assert not set(CLI_ONLY + RUNNER_ONLY) & set(cfg.keys())
    # The model's keys all travel: the model config is the loaded config without the run options.
    assert set(cfg.keys()) == set(cli.keys()) - set(CLI_ONLY + RUNNER_ONLY)
  assert from_cli == from_vllm  # the same model config, whichever way it was built


@pytest.mark.parametrize("key, value", [("prompt", "hi"), ("max_new_tokens", 4), ("cpu_weight_panels", False)])
def test_vllm_overrides_may_not_set_run_options(key, value):
  with pytest.raises(ConfigError, match=rf"additional_config\['maxtext_config'\] sets {key}: options of a"):
    maxtext_config_from_vllm(fake_vllm_config({"model_name": "llama-tiny", key: value}))


@pytest.mark.parametrize(
    "key, value, instead",
    [
        ("max_target_length", 4096, "vLLM's --max-model-len"),
        ("max_num_seqs", 8, "vLLM's --max-num-seqs"),
        ("max_num_batched_tokens", 512, "vLLM's --max-num-batched-tokens"),
        ("enable_prefix_caching", True, "vLLM's --enable-prefix-caching"),
        ("num_kv_blocks", 64, "vLLM's --num-gpu-blocks-override"),
        ("kv_cache_memory_bytes", 1 << 20, "vLLM's --kv-cache-memory-bytes"),
        ("min_token_bucket", 16, "tpu-inference's own token padding"),
        ("quantization", "int8w", "nothing: the CPU engine's cpu kernels read int8 weights"),
        ("greedy_head_candidates", 64, "nothing: the runner samples from the full logits"),
    ],
)
def test_vllm_overrides_may_not_set_keys_only_the_cpu_engine_applies(key, value, instead):
  message = (
      rf"additional_config\['maxtext_config'\] sets {key}={value!r}, which only maxtext's CPU engine applies; under"
      rf" vLLM it would do nothing \(in its place: {re.escape(instead)}"
  )
  with pytest.raises(ConfigError, match=message):
    maxtext_config_from_vllm(fake_vllm_config({"model_name": "llama-tiny", key: value}))


def test_the_model_takes_one_config():
  cfg = load_config(model_name="llama-tiny")
  with pytest.raises(TypeError, match="takes a vllm_config or a built_config, not both"):
    MaxTextForCausalLM(fake_vllm_config(), jax.random.key(0), None, built_config=cfg)
  with pytest.raises(TypeError, match="needs a vllm_config"):
    MaxTextForCausalLM(None, jax.random.key(0), None)
  with pytest.raises(TypeError, match="takes a config built by load_config, got dict"):
    MaxTextForCausalLM.from_config({"model_name": "llama-tiny"}, jax.random.key(0), None)
  # A built config names no checkpoint: random weights, as vLLM's load_format="dummy".
  assert MaxTextForCausalLM.from_config(cfg, jax.random.key(0), None).is_dummy


def test_real_weights_need_a_source():
  model = MaxTextForCausalLM(fake_vllm_config({"model_name": "llama-tiny"}), jax.random.key(0), None)
  assert not model.is_dummy
  with pytest.raises(ValueError, match="none of load_parameters_path .*, hf_model_path and gguf_model_path is set"):
    model.load_weights(jax.random.key(0))


def test_modules_walk_the_model_as_vllms_engine_cleanup_does():
  """vLLM's offline engine iterates `model.modules()` when it is released (torch's walk, looking for torch.compile
  wrappers to unhook): the model first, then every nnx module inside it exactly once, real or abstract weights."""
  for model in (_model("llama-tiny"), MaxTextForCausalLM(fake_vllm_config({"model_name": "llama-tiny"}), None)):
    modules = list(model.modules())
    assert modules[0] is model
    assert len({id(m) for m in modules}) == len(modules) == len(list(nnx.iter_modules(model)))
    assert all(isinstance(m, nnx.Module) for m in modules)
    assert model.model in modules and all(layer in modules for layer in model.model.layers)


def test_mrope_positions_are_normalised():
  # Text-only MRoPE positions are three equal streams [3, T]; the adapter uses stream 0.
  model = _model("llama-tiny")
  cfg = model.cfg
  tokens = jnp.asarray([5, 9, 4], jnp.int32)
  md = _metadata(cfg, tokens)
  flat = md.groups[0]
  mrope = GroupedAttentionMetadata(
      [
          AttentionMetadata(
              input_positions=jnp.stack([flat.input_positions] * 3),
              block_tables=flat.block_tables,
              seq_lens=flat.seq_lens,
              query_start_loc=flat.query_start_loc,
              request_distribution=flat.request_distribution,
              mamba_state_indices=flat.mamba_state_indices,
              padded_num_reqs=flat.padded_num_reqs,
          )
      ],
      md.layer_names_per_group,
  )
  caches, layer_map = _hybrid_layout(cfg)
  _, plain, _, _ = model(caches, tokens, md, None, None, layer_map)
  _, from_mrope, _, _ = model(
      _hybrid_layout(cfg)[0], tokens, mrope, None, jnp.stack([flat.input_positions] * 3), layer_map
  )
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(from_mrope))


@pytest.mark.slow
def test_model_step_has_the_same_hlo_under_the_layer_order_and_the_hybrid_map():
  """The remap is free in the compiled step: layer order vs recurrent-first gives identical op counts."""
  model = _model()
  cfg = model.cfg
  tokens = jnp.asarray([5, 9, 200, 17], jnp.int32)
  hybrid_caches, hybrid_map = _hybrid_layout(cfg)
  by_layer = sorted(range(len(hybrid_caches)), key=lambda slot: int(dict(map(reversed, hybrid_map))[slot][6:]))
  layer_caches = [hybrid_caches[slot] for slot in by_layer]
  layer_map = tuple((f"layer.{i}", i) for i in range(cfg.base_num_decoder_layers))
  graphdef, state = nnx.split(model)

  def run(state, kv_caches, md, layer_map):
    m = nnx.merge(graphdef, state)
    return m(kv_caches, tokens, md, None, None, layer_map)[:2]

  counts = []
  for caches, lmap in ((layer_caches, layer_map), (hybrid_caches, hybrid_map)):
    lowered = jax.jit(run, donate_argnums=1, static_argnums=3).lower(state, caches, _metadata(cfg, tokens), lmap)
    counts.append(
        (
            count_jaxpr_equations(jax.make_jaxpr(run, static_argnums=3)(state, caches, _metadata(cfg, tokens), lmap)),
            count_hlo_instructions(lowered.compile().as_text()),
        )
    )
  assert hybrid_map != layer_map
  print("jaxpr equations, HLO instructions (layer order, hybrid map):", counts)
  assert counts[0] == counts[1], counts


def _gemma3_shared_arrays(cfg, tokens, grouped=True):
  """tpu-inference 0.32.0's allocation for gemma3-tiny (2 sliding : 1 full) under vLLM's grouping: 3 KV-cache
  groups {0, 3}, {1, 4}, {2, 5}, and one array per position within a group, so layers 0-2 share kv_caches[0] and
  3-5 share kv_caches[1]. Each group draws its own blocks from the one pool (disjoint block ids)."""
  t = len(tokens)
  spec = kv_cache_spec.get_layer_spec(cfg, 0)
  caches = [jnp.zeros(spec.cache_shape(NUM_BLOCKS * 4), spec.dtype) for _ in range(2)]
  layer_map = tuple((f"layer.{i}", i // 3) for i in range(6))
  per_req = NUM_BLOCKS  # block-table width per request

  def md(first_block):
    table = np.zeros(MAX_REQS * per_req, np.int32)
    table[: -(-t // cfg.block_size)] = np.arange(first_block, first_block + -(-t // cfg.block_size))
    return AttentionMetadata(
        input_positions=jnp.arange(t, dtype=jnp.int32),
        block_tables=jnp.asarray(table),
        seq_lens=jnp.asarray([t] + [0] * (MAX_REQS - 1), jnp.int32),
        query_start_loc=jnp.asarray([0] + [t] * MAX_REQS, jnp.int32),
        request_distribution=jnp.asarray([0, 0, 1], jnp.int32),
        padded_num_reqs=MAX_REQS,
    )

  if not grouped:
    return caches, layer_map, GroupedAttentionMetadata([md(1)], [[f"layer.{i}" for i in range(6)]])
  groups = [md(1 + 8 * g) for g in range(3)]
  return (
      caches,
      layer_map,
      GroupedAttentionMetadata(groups, [["layer.0", "layer.3"], ["layer.1", "layer.4"], ["layer.2", "layer.5"]]),
  )


@pytest.mark.slow
def test_layers_of_different_groups_sharing_one_array_each_keep_their_writes():
  """Each layer reads the shared array as the layers before it left it (not the step's input), so all keep their
  K/V: the logits equal the dense forward, and each group's blocks hold its own layers' K/V."""
  model = _model("gemma3-tiny")
  cfg = model.cfg
  tokens = jnp.asarray([5, 9, 200, 17, 3, 44, 81, 7, 300, 11], jnp.int32)
  caches, layer_map, md = _gemma3_shared_arrays(cfg, tokens)
  call, _ = _runner_step(model)
  new_caches, hidden, _, _ = call(caches, tokens, md, layer_map)
  dense = model.model(tokens[None])[0]
  np.testing.assert_allclose(np.asarray(model.compute_logits(hidden)), np.asarray(dense), atol=1e-4, rtol=0)
  for array in new_caches:  # blocks 1-3, 9-11 and 17-19: one group's each, all written
    written = np.abs(np.asarray(array)).reshape(array.shape[0], -1).sum(axis=1) > 0
    assert sorted(np.flatnonzero(written)) == [1, 2, 3, 9, 10, 11, 17, 18, 19]


def test_writers_of_one_group_sharing_an_array_are_refused():
  """The same map with one metadata for every layer means one group: layers 0-2 would write the same blocks."""
  model = _model("gemma3-tiny")
  tokens = jnp.asarray([5, 9, 200], jnp.int32)
  caches, layer_map, md = _gemma3_shared_arrays(model.cfg, tokens, grouped=False)
  call, _ = _runner_step(model)
  with pytest.raises(
      ValueError,
      match=r"kv_caches\[0\] by layer.0, layer.1, layer.2 \(KV-cache group 0\); kv_caches\[1\] by layer.3, layer.4,"
      r" layer.5 \(KV-cache group 0\)",
  ):
    call(caches, tokens, md, layer_map)


def test_vllm_model_folder_and_dtype_feed_the_config(tmp_path):
  """`LLM(model=FOLDER, dtype=...)`: the folder is the Hugging Face checkpoint unless the overrides name one, and
  the runner's torch dtype (read by name) sets dtype and weight_dtype unless overridden."""
  (tmp_path / "config.json").write_text(
      '{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,'
      ' "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}'
  )

  def config(dtype="torch.bfloat16", **overrides):
    return maxtext_config_from_vllm(fake_vllm_config(overrides, model=str(tmp_path), dtype=dtype))

  cfg = config()
  assert cfg.hf_model_path == str(tmp_path) and cfg.vocab_size == 300 and cfg.base_num_decoder_layers == 2
  assert cfg.dtype == cfg.weight_dtype == "bfloat16"
  assert config(dtype="torch.float32", weight_dtype="bfloat16").weight_dtype == "bfloat16"
  assert config(model_name="llama-tiny").hf_model_path == ""  # the overrides name the model
  with pytest.raises(ValueError, match=r"model_config.dtype must be one of float32, bfloat16 .*; got 'float16'"):
    config(dtype="torch.float16")
