"""A layer kind defined only here, registered with one call, runs through every path of the package.

`RunningMean` keeps a recurrent state of its own (the running sum of its inputs, one fp32 row per state slot) and
outputs `out(sum_{s<=t} x_s / (t + 1))`. Nothing outside this file knows it: the config accepts its name in
`layer_types`, the decoder builds it, the KV-cache specs ask the runner for its state, the reference runner
allocates, zeroes and frees its slots, and the paged path carries the sum across chunked prefills and decodes.
Every layout must give the dense forward's greedy tokens, with no slot leaked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import kv_cache_checks, param_checks
from maxtext.configs import load_config
from maxtext.inference import LLM, SamplingParams
from maxtext.kv_cache import kv_cache_spec
from maxtext.kv_cache.cache_spec import RecurrentSpec
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.linears import DenseGeneral
from maxtext.layers.mixer import Mixer, register_mixer
from maxtext.models import Transformer

KIND = "running_mean"
LAYER_TYPES = [KIND, "full_attention", KIND, "full_attention"]
MAX_TOKENS = 6
EOS = 2


@register_mixer
class RunningMean(Mixer):
  """Toy recurrent mixer: the mean of the inputs so far, projected."""

  layer_types = (KIND,)
  cache_kind = "recurrent"
  param_name = "running_mean"

  def __init__(self, emb_dim: int, *, rngs: nnx.Rngs):
    self.out = DenseGeneral(emb_dim, emb_dim, rngs=rngs)

  @classmethod
  def from_config(cls, cfg, layer_index, *, rngs):
    """One projection of width D."""
    del layer_index
    return cls(cfg.base_emb_dim, rngs=rngs)

  @classmethod
  def cache_spec(cls, cfg, layer_index):
    """One fp32 row of D per state slot."""
    return RecurrentSpec(cfg.layer_types[layer_index], ("sum",), ((cfg.base_emb_dim,),), ("float32",))

  @classmethod
  def declare(cls, cfg, layer_index, stored=()):
    """`out.kernel [D, D]`, its input axis sharded as the hidden state is; no checkpoint holds this kind."""
    del cfg, layer_index, stored
    return [ParamDecl("out.kernel", ("embed", None))]

  def __call__(self, x, positions, shared_kv=None, *, chunked=True):  # pylint: disable=arguments-differ
    """The running mean over the whole sequence, projected."""
    del chunked
    assert shared_kv is None
    running = jnp.cumsum(x.astype(jnp.float32), axis=1)
    return self.out(running / (positions[..., None] + 1.0)), None

  def paged(self, x, positions, cache, md, backend):
    """Each request's running sum continues from its state slot and is written back at its last token."""
    # Plain JAX ops for the sum (a real kind would add its op to the kernel backend); the projection is the
    # backend's, as every dense product of the paged path is (it may hold the kernel in a layout of its own).
    (sums,) = cache
    t, s = x.shape[0], md.seq_lens.shape[0]
    qsl = md.query_start_loc
    num_reqs = md.request_distribution[2]
    tokens = jnp.arange(t)
    request = jnp.clip(jnp.searchsorted(qsl[1:], tokens, side="right"), 0, s - 1)
    valid = tokens < qsl[num_reqs]
    q_len = qsl[1:] - qsl[:-1]
    has_state = (md.seq_lens - q_len) > 0  # a request resuming after earlier steps
    initial = jnp.where(has_state[:, None], sums[md.mamba_state_indices], 0.0)  # [S, D]
    cumulative = jnp.cumsum(jnp.where(valid[:, None], x.astype(jnp.float32), 0.0), axis=0)
    start = qsl[request]
    before = jnp.where((start > 0)[:, None], cumulative[jnp.maximum(start - 1, 0)], 0.0)
    running = cumulative - before + initial[request]
    final = running[jnp.clip(qsl[1:] - 1, 0, t - 1)]  # [S, D] at each request's last token
    writes = (jnp.arange(s) < num_reqs) & (q_len > 0)
    rows = jnp.where(writes, md.mamba_state_indices, sums.shape[0])  # out of range: dropped
    sums = sums.at[rows].set(final, mode="drop")
    return self.out(running / (positions[:, None] + 1.0), backend), (sums,)


def _config(**overrides):
  values = {
      "decoder_block": "llama2",
      "base_num_decoder_layers": len(LAYER_TYPES),
      "layer_types": LAYER_TYPES,
      "block_size": 4,
      "num_kv_blocks": 64,
      "max_num_batched_tokens": 16,
      "max_target_length": 96,
      "seed": 5,
  }
  values.update(overrides)
  return values


def _prompts():
  rng = np.random.default_rng(7)
  return [[int(t) for t in rng.integers(3, 512, n)] for n in (5, 18, 29)]


def _dense_greedy(model, prompt):
  tokens, out = list(prompt), []
  logits_fn = jax.jit(lambda ids: model(ids[None])[0])
  for _ in range(MAX_TOKENS):
    padded = jnp.asarray(tokens + [0] * (64 - len(tokens)), jnp.int32)
    token = int(jnp.argmax(logits_fn(padded)[len(tokens) - 1]))
    out.append(token)
    tokens.append(token)
    if token == EOS:
      break
  return out


def test_the_toy_kind_is_a_recurrent_layer_everywhere():
  cfg = load_config(**_config())
  spec = kv_cache_spec.get_layer_spec(cfg, 0)
  assert spec.cache_kind == "recurrent" and spec.cache_shapes(3) == ((3, 64),)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert isinstance(model.layers[0].mixer, RunningMean) and "running_mean" in vars(model.layers[0])
  with pytest.raises(ValueError, match=r"layer.0 is a running_mean layer and needs a recurrent state \(sum"):
    spec.validate("layer.0", jnp.zeros((4, 64)), 0)
  with pytest.raises(ValueError, match="num_kv_shared_layers=2: layer 2 is running_mean; only attention layers"):
    load_config(**_config(num_kv_shared_layers=2))


@pytest.mark.slow
def test_paged_sum_matches_the_dense_forward_at_the_first_prompt():
  llm = LLM(**_config())
  model = param_checks.canonical_model(llm.engine)
  prompt = _prompts()[1]
  dense = np.asarray(model(jnp.asarray([prompt], jnp.int32))[0, -1])
  first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
  assert first == int(np.argmax(dense))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["layer", "hybrid", "shuffled"])
def test_every_layout_gives_the_dense_greedy_tokens(layout):
  llm = LLM(**_config(kv_cache_layout=layout))
  manager = llm.engine.manager
  recurrent_first = [name for name, _ in sorted(manager.layer_name_to_kvcache_index, key=lambda p: p[1])]
  if layout == "hybrid":  # recurrent slots first, as tpu-inference allocates
    assert recurrent_first[:2] == ["layer.0", "layer.2"]
  assert [g.kind for g in manager.groups][0] == "recurrent" and manager.groups[0].layer_names == ("layer.0", "layer.2")
  prompts = _prompts()
  outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
  assert kv_cache_checks.all_free(llm.engine.manager), "blocks or state slots leaked"
  assert llm.engine.stats.steps > MAX_TOKENS  # the 29-token prompt was chunked over the 16-token budget
  model = param_checks.canonical_model(llm.engine)
  assert [list(o.outputs[0].token_ids) for o in outs] == [_dense_greedy(model, p) for p in prompts]
