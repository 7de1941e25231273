"""End to end through the public API: every physical layout and grouping gives the dense forward's greedy tokens.

The reference runner allocates caches in the order `kv_cache_layout` says (layer order, recurrent-first as
tpu-inference does, or a seeded shuffle), forms KV-cache groups per `hybrid_kv_cache`, batches requests with
chunked prefill and preempts when blocks run out. None of that may change a single token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import kv_cache_checks, param_checks
from maxtext.configs import available_models
from maxtext.inference import LLM, SamplingParams

# Every tiny config in configs/models: a new family is covered as soon as its tiny config exists.
FAMILIES = [name for name in available_models() if name.endswith("-tiny")]
LAYOUTS = [("hybrid", True), ("layer", False), ("shuffled", True)]
MAX_TOKENS = 8
EOS = 2  # the byte-level tokenizer's eos id
PAD_TO = 64


def _prompts(seed=0, lengths=(7, 19, 33)):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 512, n)] for n in lengths]


def _llm(name, layout, hybrid, **overrides):
  kw = {
      "model_name": name,
      "kv_cache_layout": layout,
      "hybrid_kv_cache": hybrid,
      "block_size": 4,
      "num_kv_blocks": 64,
      "max_num_batched_tokens": 16,
      # One token bucket (the budget's): every step of an engine runs one compiled program, so each layout
      # costs one compile. Small buckets are tested where bucketing is the point (tests/unit/inference).
      "min_token_bucket": 16,
      "max_num_seqs": 8,
      "max_target_length": 128,
      "seed": 3,
  }
  kw.update(overrides)
  return LLM(**kw)


def _dense_greedy(model, prompts):
  """Greedy decode of each prompt by repeated full-sequence forwards (the GDN recurrence in its per-token form, as
  the kernels run it), stopping at eos like the engine. One jitted forward (padded to PAD_TO) serves every call."""

  @jax.jit
  def next_logits(tokens):
    return model(tokens[None], gdn_chunked=False)[0]

  outs = []
  for prompt in prompts:
    tokens = list(prompt)
    out = []
    for _ in range(MAX_TOKENS):
      padded = jnp.asarray(tokens + [0] * (PAD_TO - len(tokens)), jnp.int32)
      token = int(jnp.argmax(next_logits(padded)[len(tokens) - 1]))
      out.append(token)
      tokens.append(token)
      if token == EOS:
        break
    outs.append(out)
  return outs


def _generate(llm, prompts):
  outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
  assert kv_cache_checks.all_free(llm.engine.manager), "blocks or state slots leaked"
  return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_every_layout_gives_the_dense_greedy_tokens(name):
  prompts = _prompts()
  results = {}
  for layout, hybrid in LAYOUTS:
    llm = _llm(name, layout, hybrid)
    results[(layout, hybrid)] = _generate(llm, prompts)
    # Chunked prefill really happened: the 33-token prompt cannot fit the 16-token budget.
    assert llm.engine.stats.steps > MAX_TOKENS
  model = param_checks.canonical_model(llm.engine)
  expected = _dense_greedy(model, prompts)
  for key, tokens in results.items():
    assert tokens == expected, f"{name} {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-next-tiny", "kvshare-tiny"])
def test_preemption_with_few_blocks_keeps_every_request_and_token(name):
  prompts = _prompts(seed=1, lengths=(9, 21, 30, 14))
  roomy = _generate(_llm(name, "hybrid", True), prompts)
  # 13 usable blocks per attention group: kvshare-tiny has four groups of one layer (vLLM's rule).
  tight = _llm(name, "shuffled", True, num_kv_blocks={"kvshare-tiny": 53}.get(name, 14))
  assert _generate(tight, prompts) == roomy
  assert tight.engine.stats.preemptions > 0


@pytest.mark.slow
def test_sliding_groups_free_out_of_window_blocks_during_a_long_decode():
  llm = _llm("gemma3-tiny", "hybrid", True, num_kv_blocks=24)
  prompts = _prompts(seed=2, lengths=(40,))
  sliding = [g for g in llm.engine.manager.groups if g.sliding_window]
  full = [g for g in llm.engine.manager.groups if g.kind == "attention" and not g.sliding_window]
  assert sliding and full
  rid = llm.engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=6))
  used = []
  while llm.engine.has_unfinished_requests():
    llm.engine.step()
    if llm.engine.manager.has_request(rid):
      used.append(
          (
              llm.engine.manager.num_used_blocks(sliding[0].group_id),
              llm.engine.manager.num_used_blocks(full[0].group_id),
          )
      )
  # The full-attention group keeps every block; the sliding group holds only the window's.
  assert max(s for s, _ in used) < max(f for _, f in used)
  assert kv_cache_checks.all_free(llm.engine.manager)
