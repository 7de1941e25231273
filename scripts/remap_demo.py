"""Demo: a hybrid model honoring the runner's KV-cache map inside one jitted step with the caches donated.

The layout is what tpu-inference allocates for a Qwen3.5-style model: the recurrent (Gated DeltaNet) states
`(conv, ssm)` come first, then the attention caches, and a KV-sharing layer points at its source's slot. The step
resolves the static map, gathers the caches in layer order, lets every layer write a marker (its number + 1),
scatters back to the physical order, and then checks that each marker landed in the layer's own slot. It also
shows that the remap costs nothing: the program has as many jaxpr equations and compiled HLO instructions as
under the layer-order layout.

Run: python scripts/remap_demo.py   (exit status 0 when every check passes, 1 otherwise)
"""

import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

import jax
import jax.numpy as jnp
import numpy as np

from support import hlo
from maxtext.kv_cache import hybrid_cache_utils as hcu

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_KINDS = (LINEAR, LINEAR, LINEAR, FULL, LINEAR, LINEAR, LINEAR, FULL, FULL)
KV_SHARED_SOURCE = {8: 7}  # layer.8 reads layer.7's K/V and computes none of its own
STATE_SLOT = 1  # GDN state slot of the demo's one request (slot 0 is the runner's null slot)
BLOCK = 2  # attention block holding the request's first KV rows

# Tiny runner shapes (docs/runner-contract.md): GDN conv [M, K-1, C] bf16 and ssm [M, nv, dk, dv] fp32;
# attention [N, bs, 2Hkv/pk, pk, D] bf16 with pk = 2 for bf16 and D padded to 128.
CONV_SHAPE, SSM_SHAPE = (4, 3, 32), (4, 2, 8, 8)
ATTENTION_SHAPE = (6, 4, 2, 2, 128)


def physical_slots(layer_order: bool) -> tuple[int, ...]:
  """Slot of every layer: recurrent states first, then attention (runner), or in layer order; sharers reuse."""
  owners = [layer for layer in range(len(LAYER_KINDS)) if layer not in KV_SHARED_SOURCE]
  if not layer_order:
    owners.sort(key=lambda layer: LAYER_KINDS[layer] != LINEAR)  # stable: layer order within each kind
  slot_of = {layer: slot for slot, layer in enumerate(owners)}
  for reader, source in KV_SHARED_SOURCE.items():
    slot_of[reader] = slot_of[source]
  return tuple(slot_of[layer] for layer in range(len(LAYER_KINDS)))


def allocate_kv_caches(slots: tuple[int, ...]) -> list[Any]:
  """Zero-filled caches in physical order: a (conv, ssm) tuple per recurrent slot, an array per attention slot."""
  caches: list[Any] = [None] * (max(slots) + 1)
  for layer, slot in enumerate(slots):
    if LAYER_KINDS[layer] == LINEAR:
      caches[slot] = (jnp.zeros(CONV_SHAPE, jnp.bfloat16), jnp.zeros(SSM_SHAPE, jnp.float32))
    else:
      caches[slot] = jnp.zeros(ATTENTION_SHAPE, jnp.bfloat16)
  return caches


def step(kv_caches: list[Any], layer_name_to_kvcache_index: tuple[tuple[str, int], ...]) -> tuple[list[Any], dict]:
  """One decoder step over the remapped caches; returns the physical caches and what KV-sharing layers read."""
  layer_indices = hcu.resolve_layer_kv_cache_indices(layer_name_to_kvcache_index, len(LAYER_KINDS), len(kv_caches))
  layer_caches = hcu.gather_layer_kv_caches(kv_caches, layer_indices)
  reads = {}
  for layer, kind in enumerate(LAYER_KINDS):
    cache = layer_caches[layer]
    marker = float(layer + 1)
    if layer in KV_SHARED_SOURCE:
      reads[layer] = cache[BLOCK, 0, 0, 0, 0]  # reads its source's K/V, writes nothing
      continue
    if kind == LINEAR:
      conv, ssm = cache
      new_cache = (conv.at[STATE_SLOT].set(marker), ssm.at[STATE_SLOT].add(marker))
    else:
      new_cache = cache.at[BLOCK, 0].set(marker)
    # Later layers sharing this slot read what this layer just wrote.
    for other in range(layer, len(LAYER_KINDS)):
      if layer_indices[other] == layer_indices[layer]:
        layer_caches[other] = new_cache
  return hcu.scatter_layer_kv_caches(kv_caches, layer_caches, layer_indices), reads


def _describe(cache: Any) -> str:
  if isinstance(cache, tuple):
    conv, ssm = cache
    return f"conv {conv.shape} {conv.dtype}, ssm {ssm.shape} {ssm.dtype}"
  return f"{cache.shape} {cache.dtype}"


def _check_layer(layer: int, cache: Any, reads: dict) -> str | None:
  """Returns a failure message if layer `layer`'s marker is not where it belongs in its physical slot."""
  if layer in KV_SHARED_SOURCE:
    source = KV_SHARED_SOURCE[layer]
    read = float(reads[layer])
    return None if read == source + 1 else f"read {read} from its slot, expected layer.{source}'s marker {source + 1}"
  marker = layer + 1
  if LAYER_KINDS[layer] == LINEAR:
    conv, ssm = (np.asarray(member, np.float32) for member in cache)
    written = np.all(conv[STATE_SLOT] == marker) and np.all(ssm[STATE_SLOT] == marker)
    untouched = not np.any(conv[0]) and not np.any(ssm[0])
  else:
    array = np.asarray(cache, np.float32)
    written = np.all(array[BLOCK, 0] == marker)
    untouched = not np.any(array[BLOCK, 1:]) and not np.any(array[:BLOCK])
  if not written:
    return f"marker {marker} missing from its slot"
  return None if untouched else "wrote outside its state slot / block row"


def _program_size(kv_caches: list[Any], pairs: tuple[tuple[str, int], ...]) -> tuple[int, int]:
  eqns = hlo.count_jaxpr_equations(jax.make_jaxpr(step, static_argnums=1)(kv_caches, pairs))
  compiled = jax.jit(step, static_argnums=1, donate_argnums=0).lower(kv_caches, pairs).compile()
  return eqns, hlo.count_hlo_instructions(compiled.as_text())


def main() -> int:
  """Runs the demo; returns the process exit status."""
  slots = physical_slots(layer_order=False)
  pairs = tuple((hcu.layer_name(layer), slot) for layer, slot in enumerate(slots))
  print(f"runner map (static): {pairs}")
  kv_caches = allocate_kv_caches(slots)
  donated = kv_caches[0][0]

  new_caches, reads = jax.jit(step, static_argnums=1, donate_argnums=0)(kv_caches, pairs)
  failures = []
  print(f"{'layer':<9}{'kind':<18}{'slot':>4}  {'cache':<52}check")
  for layer, slot in enumerate(slots):
    kind = LAYER_KINDS[layer] + (" (KV-shared)" if layer in KV_SHARED_SOURCE else "")
    problem = _check_layer(layer, new_caches[slot], reads)
    print(f"{hcu.layer_name(layer):<9}{kind:<18}{slot:>4}  {_describe(new_caches[slot]):<52}{problem or 'ok'}")
    if problem:
      failures.append(f"{hcu.layer_name(layer)} (kv_caches[{slot}]): {problem}")
  print(f"kv_caches donated: {donated.is_deleted()}")

  identity = physical_slots(layer_order=True)
  identity_pairs = tuple((hcu.layer_name(layer), slot) for layer, slot in enumerate(identity))
  identity_size = _program_size(allocate_kv_caches(identity), identity_pairs)
  remapped_size = _program_size(allocate_kv_caches(slots), pairs)
  print(f"layer-order map: {identity_size[0]} jaxpr equations, {identity_size[1]} HLO instructions")
  print(f"runner map:      {remapped_size[0]} jaxpr equations, {remapped_size[1]} HLO instructions")
  if identity_size != remapped_size:
    failures.append(f"the remap changed the program size: {identity_size} vs {remapped_size}")

  if failures:
    print("FAILED: " + "; ".join(failures), file=sys.stderr)
    return 1
  print("all layers wrote their own slot; the remap added no operation")
  return 0


if __name__ == "__main__":
  sys.exit(main())
