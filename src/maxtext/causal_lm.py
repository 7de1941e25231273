"""`CausalLM`: this package's model behind the runner's positional calling contract, built from a config.

tpu-inference's runner and this package's CPU reference runner call the same methods:

    __call__(kv_caches, input_ids, attention_metadata, inputs_embeds, input_positions,
             layer_name_to_kvcache_index, lora_metadata, intermediate_tensors, is_first_rank, is_last_rank)

inside `jax.jit` with `kv_caches` donated and the map static, returning `(kv_caches, hidden [T, D],
aux_hidden_states, expert_indices)` (docs/runner-contract.md); then `compute_logits`, `embed_input_ids`,
`load_weights`. The physical `kv_caches` list is in the runner's order; the map says which slot each `layer.<i>`
uses. Resolution, gathering and scattering are plain Python over traced values (`kv_cache.hybrid_cache_utils`), so
the remap adds no XLA operation. Every runner op goes through the kernel backend that `kernel_backend` names, built
with the mesh. vLLM's constructor, `cls(vllm_config, rng_key, mesh)`, is the subclass
`integration.vllm.adapter.MaxTextForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from maxtext.checkpoint import load_model, source
from maxtext.configs import run_options
from maxtext.kv_cache import hybrid_cache_utils, kv_cache_spec
from maxtext.kernels.attention_metadata import AttentionMetadata, metadata_for_layers, normalize_positions
from maxtext.kernels.backend import get_backend
from maxtext.models import Transformer, abstract_model, sharding

# The config keys that name a checkpoint; with none of them the model has random weights.
CHECKPOINT_KEYS = source.SOURCE_KEYS


class CausalLM(nnx.Module):
  """The runner-facing model: resolves the cache map, runs the paged decoder, returns the runner's 4-tuple."""

  def __init__(
      self,
      cfg: ml_collections.FrozenConfigDict,
      rng_key: jax.Array,
      mesh: jax.sharding.Mesh | None = None,
      *,
      is_dummy: bool,
      run_config: ml_collections.FrozenConfigDict | None = None,
  ):
    """Builds the model of a model config (`run_options.model_config`); see `from_config` for a run's config.

    Args:
      cfg: the model's config, without run options.
      rng_key: the key of random (dummy) weights.
      mesh: the runner's device mesh, or None for one device.
      is_dummy: whether the weights are random (created here) rather than loaded by `load_weights`.
      run_config: the run's config, whose run options configure the kernel backend (`cpu_weight_panels`, ...);
        None (under vLLM, which carries none) keeps the backend's defaults.
    """
    self.mesh = mesh
    self.cfg = cfg
    self.is_dummy = is_dummy
    self.backend = get_backend(self.cfg.kernel_backend, mesh, run_config)
    self.num_layers = self.cfg.base_num_decoder_layers
    if self.is_dummy:
      # With dummy weights the runner never calls load_weights; upstream MaxText initialises here too.
      self.load_weights(rng_key)
    else:
      self.model = abstract_model(self.cfg)

  @classmethod
  def from_config(
      cls, cfg: ml_collections.FrozenConfigDict, rng_key: jax.Array, mesh: jax.sharding.Mesh | None = None
  ) -> CausalLM:
    """The model of a config this package already built (`load_run_config`): the reference runner's constructor.

    The model keeps `cfg`'s model keys only (`run_options.model_config`), the same config
    `adapter.maxtext_config_from_vllm` builds from the same keys, and has random weights when `cfg` names no
    checkpoint (vLLM's `load_format="dummy"`).

    Raises:
      TypeError: `cfg` is not a built config.
    """
    model_cfg = run_options.model_config(cfg)
    return cls(model_cfg, rng_key, mesh, is_dummy=not any(model_cfg[key] for key in CHECKPOINT_KEYS), run_config=cfg)

  @property
  def is_sharded(self) -> bool:
    """Whether the model runs on a mesh of more than one device."""
    return self.mesh is not None and self.mesh.size > 1

  def load_weights(self, rng_key: jax.Array) -> None:
    """Creates the parameters: random from `rng_key` (dummy), else from `load_parameters_path`, `hf_model_path` or
    `gguf_model_path`.

    On a mesh of several devices random parameters are created directly in their shardings, and loaded ones are
    placed there one parameter at a time (`maxtext.models.sharding`).

    Raises:
      ValueError: real weights were asked for but neither checkpoint source is configured.
    """
    cfg = self.cfg
    if self.is_dummy:
      if self.is_sharded:
        self.model = sharding.create_sharded_model(cfg, self.mesh, rng_key)
      else:
        self.model = Transformer(cfg, rngs=nnx.Rngs(params=rng_key))
      return
    if source.weights_source(cfg) is None:
      raise ValueError(
          "load_format is not 'dummy' but none of load_parameters_path (Orbax), hf_model_path and gguf_model_path"
          " is set in additional_config['maxtext_config']"
      )
    model = load_model(cfg, into=self.model)  # the constructor's abstract model: no second trace of it
    self.model = sharding.shard_model(model, cfg, self.mesh) if self.is_sharded else model

  def kv_cache_shardings(self, kv_caches: list[Any]) -> list[Any]:
    """The runner's sharding of every physical cache (a tuple per recurrent slot), or None without a mesh.

    The owner of each slot is any layer whose spec matches the cache's kind; all slots of one kind are laid out
    alike, so the spec of the first layer of that kind gives the sharding.
    """
    if not self.is_sharded:
      return [None] * len(kv_caches)
    specs = [kv_cache_spec.get_layer_spec(self.cfg, i) for i in range(self.num_layers)]
    attention = next((s for s in specs if s.cache_kind == "attention"), None)
    recurrent = next((s for s in specs if s.cache_kind == "recurrent"), None)
    out = []
    for slot, cache in enumerate(kv_caches):
      where = f"kv_caches[{slot}]"
      if isinstance(cache, (tuple, list)):
        out.append(tuple(sharding.cache_sharding(recurrent, c.shape, self.mesh, where) for c in cache))
      else:
        out.append(sharding.cache_sharding(attention, cache.shape, self.mesh, where))
    return out

  def shard_kv_caches(self, kv_caches: list[Any]) -> list[Any]:
    """Places freshly allocated caches in the runner's shardings (unchanged without a mesh)."""
    if not self.is_sharded:
      return list(kv_caches)
    return jax.tree_util.tree_map(jax.device_put, list(kv_caches), self.kv_cache_shardings(kv_caches))

  # The runner's positional contract fixes this signature (keywords with defaults, then *args): see
  # docs/runner-contract.md.
  def __call__(  # pylint: disable=arguments-differ,keyword-arg-before-vararg
      self,
      kv_caches: list[Any],
      input_ids: jax.Array | None,
      attention_metadata: AttentionMetadata | Mapping[str, AttentionMetadata],
      inputs_embeds: jax.Array | None = None,
      input_positions: jax.Array | None = None,
      layer_name_to_kvcache_index: Any = None,
      *args: Any,
      **kwargs: Any,
  ) -> tuple[list[Any], jax.Array, list[jax.Array], None]:
    """One runner step over a flat ragged batch.

    Args:
      kv_caches: the runner's physical cache list (donated): attention arrays `[N, bs, 2Hkv/pk, pk, Dpad]` and
        recurrent `(conv [M, K-1, C], state [M, nv, dk, dv])` tuples.
      input_ids: `[T]` int32 token ids, padded with 0 (None when `inputs_embeds` is given).
      attention_metadata: one `AttentionMetadata`, or `{layer_name: AttentionMetadata}` per KV-cache group.
      inputs_embeds: `[T, D]` embeddings instead of `input_ids` (multimodal), or None.
      input_positions: `[T]` (or `[3, T]`), the same array as the metadata's `input_positions`; the metadata's
        copy is the one used, this one must agree in shape.
      layer_name_to_kvcache_index: static `(("layer.<i>", slot), ...)` (or a mapping).
      *args: lora_metadata, intermediate_tensors, is_first_rank, is_last_rank: accepted and ignored (no LoRA,
        no pipeline parallelism).
      **kwargs: accepted and ignored (the runner adds keywords over time).

    Returns:
      `(kv_caches in the runner's order, hidden [T, D], [], None)`.

    Raises:
      ValueError / TypeError: a bad map, a slot that does not hold what its layer needs, or inconsistent inputs.
    """
    del args, kwargs  # Positional extras of the runner's contract that this model does not use.
    if layer_name_to_kvcache_index is None:
      raise ValueError(
          "layer_name_to_kvcache_index is required: the runner's kv_caches order is not the layer order "
          f"(pass (('layer.0', slot), ...) for all {self.num_layers} layers)"
      )
    layer_indices = hybrid_cache_utils.resolve_layer_kv_cache_indices(
        layer_name_to_kvcache_index, self.num_layers, len(kv_caches)
    )
    layer_caches = hybrid_cache_utils.gather_layer_kv_caches(kv_caches, layer_indices)
    kv_cache_spec.validate_layer_caches(self.cfg, layer_caches, layer_indices)
    layer_metadata = metadata_for_layers(
        attention_metadata,
        [hybrid_cache_utils.layer_name(i) for i in range(self.num_layers)],
        kv_cache_spec.get_shared_kv_cache_layers(self.cfg),
    )
    group_of: dict[int, int] = {}  # metadata object -> KV-cache group, numbered in layer order
    for md in layer_metadata:
      group_of.setdefault(id(md), len(group_of))
    hybrid_cache_utils.check_shared_slot_writers(
        layer_indices, [group_of[id(md)] for md in layer_metadata], [src >= 0 for src in self.cfg.kv_shared_source]
    )
    positions = normalize_positions(layer_metadata[0].input_positions) if layer_metadata else None
    if input_positions is not None and positions is not None:
      if tuple(input_positions.shape) != tuple(layer_metadata[0].input_positions.shape):
        raise ValueError(
            f"input_positions has shape {tuple(input_positions.shape)} but attention_metadata.input_positions has "
            f"{tuple(layer_metadata[0].input_positions.shape)}; the runner passes the same array twice"
        )
    if inputs_embeds is None:
      if input_ids is None:
        raise ValueError("one of input_ids [T] or inputs_embeds [T, D] must be given")
      x = self.model.embed(input_ids)
    else:
      x = jnp.asarray(inputs_embeds, self.model.dtype)
    if positions is not None and positions.shape[0] != x.shape[0]:
      raise ValueError(f"positions cover {positions.shape[0]} tokens but the batch has {x.shape[0]} tokens")
    hidden, new_kv_caches = self.model.forward_paged(x, positions, kv_caches, layer_indices, layer_metadata, self.backend)
    if self.is_sharded:
      # Every cache leaves the step in the runner's sharding, the one it came in with.
      new_kv_caches = jax.tree_util.tree_map(
          jax.lax.with_sharding_constraint, new_kv_caches, self.kv_cache_shardings(new_kv_caches)
      )
    return new_kv_caches, hidden.reshape(-1, hidden.shape[-1]), [], None

  def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
    """Logits `[R, V]` of hidden states `[R, D]` (already gathered at each request's last token)."""
    return self.model.compute_logits(hidden_states, self.backend)

  def greedy_token_ids(self, hidden_states: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The greedy pick `[R]` int32 of hidden states `[R, D]`, and `[R]` whether each row's logits are finite
    (`Transformer.greedy_token_ids`: through a coarse head's candidates when the backend gave it one)."""
    return self.model.greedy_token_ids(hidden_states, self.backend)

  def embed_input_ids(self, input_ids: jax.Array) -> jax.Array:
    """Token embeddings `[T, D]` of `input_ids` `[T]`."""
    return self.model.embed(input_ids)

  def get_input_embeddings(self) -> jax.Array:
    """The token embedding table `[V, D]`."""
    return self.model.embedder.embedding[...]
