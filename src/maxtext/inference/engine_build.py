"""Building the reference runner's engine: the kernel backend a mesh defaults to, the KV-cache manager of a config,
and the model's weights in the backend's layout (`EngineWeights`: from the weight cache or the checkpoint, then
placed by the backend in a thread).

`LLMEngine` (engine.py) holds what this builds and runs the loop; its step programs are step_programs.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from maxtext.causal_lm import CausalLM
from maxtext.checkpoint import weight_cache
from maxtext.inference.kv_cache_manager import KVCacheManager
from maxtext.kernels.backend import device_default_name
from maxtext.kv_cache import kv_cache_spec

logger = logging.getLogger(__name__)
# What a start is doing (loading, compiling), for a command line to show while it waits (`maxtext-decode` on a
# terminal); nothing is printed unless a program turns it on.
status = logging.getLogger("maxtext.status")


def make_kv_cache_manager(cfg: ml_collections.FrozenConfigDict) -> KVCacheManager:
  """The KV-cache manager for the caches the model of `cfg` asks for (its per-layer specs and KV sharing)."""
  return KVCacheManager(cfg, kv_cache_spec.get_kv_cache_specs(cfg), kv_cache_spec.get_shared_kv_cache_layers(cfg))


def with_default_kernel_backend(
    cfg: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh
) -> ml_collections.FrozenConfigDict:
  """`cfg` with `kernel_backend` set: the device's default (`cpu` on one CPU device, else `reference`) when empty."""
  if cfg.kernel_backend:
    return cfg
  return ml_collections.FrozenConfigDict(dict(cfg.as_configdict().to_dict(), kernel_backend=device_default_name(mesh)))


class EngineWeights:
  """The model's parameters as the step programs read them: a flat list of arrays (`leaves`; flattening the nnx
  State in Python on every call would cost milliseconds per step) in the kernel backend's layout.

  Built from the model's structure alone: a model with random weights is laid out at once; a checkpoint's model
  stays abstract until `load`, and its prepared structure comes from a copy, so the step programs can be built
  (and compiled in the background) while the weights load.

  Attributes:
    model: the model (replaced by a model over the loaded or adopted arrays).
    graphdef, state_def: the prepared structure the step programs are built for.
    leaves: the parameters, flat, in `state_def`'s order.
    prepared_bytes: the bytes the backend re-laid (0 until the weights load).
    from_cache: whether the weights came from the weight cache.
    placed_bytes: the bytes the backend's `place_params` moved, None until its thread has run.
    placing: the thread running the backend's placement, if any.
  """

  def __init__(self, cfg: ml_collections.FrozenConfigDict, model: CausalLM):
    self.cfg, self.model, self.backend = cfg, model, model.backend
    self.prepared_bytes = self.backend.prepare_params(model) if model.is_dummy else 0
    graphdef, state = nnx.split(model)
    if not model.is_dummy:
      structure = nnx.merge(graphdef, state, copy=True)
      self.backend.prepare_params(structure)
      graphdef, state = nnx.split(structure)
    self.graphdef, self.state = graphdef, state
    self.leaves, self.state_def = jax.tree_util.tree_flatten(state)
    self.from_cache = False
    self.placed_bytes: int | None = None
    self.placing: threading.Thread | None = None
    self.placing_copies: threading.Thread | None = None  # places the copies of cached weights (a daemon)
    self._placing_pending = True
    self._copied_leaves: list[Any] | None = None  # cached weights copied by the placing thread, not yet adopted

  def load(self, rng_key: jax.Array) -> None:
    """Fills the model with its prepared parameters: from the weight cache when it holds them (`weight_cache`),
    else from the checkpoint (loaded, then laid out by the backend), which is then stored there for the next start.

    Raises:
      RuntimeError: the loaded model's structure is not the one the step programs were built for.
    """
    entry = None
    if not self.model.is_sharded:
      entry = weight_cache.run_entry(self.cfg, self.backend, str(self.state_def), self.leaves)
    cached = entry[0].load(entry[1]) if entry is not None else None
    if cached is not None:
      status.info("loading the prepared weights from %s", entry[0].folder)
      # Read-only NumPy arrays over the entry's file mapping: JAX's CPU client uses their memory without a copy.
      self._adopt([jax.device_put(leaf) for leaf in cached.leaves])
      self.prepared_bytes = int(cached.extra.get("prepared_bytes", 0))
      self.from_cache = True
      return
    status.info("loading and converting the weights (kept for the next start)" if entry else "loading the weights")
    self.model.load_weights(rng_key)
    self.prepared_bytes = self.backend.prepare_params(self.model)
    loaded_graphdef, self.state = nnx.split(self.model)
    self.leaves, loaded_def = jax.tree_util.tree_flatten(self.state)
    if (loaded_graphdef, loaded_def) != (self.graphdef, self.state_def):
      raise RuntimeError("loading the weights changed the model's structure; the step programs were built for it")
    if entry is not None:
      entry[0].store(entry[1], self.leaves, {"prepared_bytes": int(self.prepared_bytes)})

  def _adopt(self, leaves: list[Any]) -> None:
    self.leaves = leaves
    self.state = jax.tree_util.tree_unflatten(self.state_def, leaves)
    self.model = nnx.merge(self.graphdef, self.state)

  def start_placing(self) -> None:
    """Starts the backend's work on the weights' memory in a thread, once (none when the backend has none).

    Called after the first step: running it while the first programs compile would take a core from those
    compiles. Steps run meanwhile, a little slower until it is done.
    """
    if not self._placing_pending:
      return
    self._placing_pending = False
    work = self.backend.place_params(self.leaves)
    if work is None:
      return
    # Placing alone is system calls, which a process may exit during. Copying cached weights calls into XLA, where
    # the interpreter's shutdown would unwind the thread inside C++ and abort the process: the exit waits for it.
    self.placing = threading.Thread(
        target=self._place,
        args=(None if self.from_cache else work,),
        name="maxtext-place-params",
        daemon=not self.from_cache,
    )
    self.placing.start()

  def _place(self, work: Callable[[], int] | None) -> None:
    """Runs the backend's `work` on the weights' memory; sets `placed_bytes`. Failures only log.

    Without `work`, the weights are views of the weight cache's file mapping, pages the backend cannot move: they
    are first copied into memory of this process (XLA calls: this thread is not a daemon, and stops copying once
    the main thread has ended, so a short run's exit does not wait for copies nobody will read), adopted by the
    next step (`adopt_copies`), and placed by a daemon thread (system calls only).
    """
    start = time.perf_counter()
    try:
      if work is None:
        copies = []
        for leaf in self.leaves:
          if not threading.main_thread().is_alive():
            return
          copies.append(jax.device_put(np.array(leaf)))
        work = self.backend.place_params(copies)
        self._copied_leaves = copies
        if work is not None:
          self.placing_copies = threading.Thread(
              target=self._place, args=(work,), name="maxtext-place-copies", daemon=True
          )
          self.placing_copies.start()
          return
      self.placed_bytes = work() if work is not None else 0
    except Exception as e:  # pylint: disable=broad-exception-caught  # an optimisation must not break the engine
      logger.warning("kernel_backend=%s: placing the weights failed (they stay where they are): %s", self.backend.name, e)
      self.placed_bytes = 0
      return
    logger.info(
        "kernel_backend=%s placed %.1f MB of weights (%.2f s)",
        self.backend.name,
        self.placed_bytes / 1e6,
        time.perf_counter() - start,
    )

  def adopt_copies(self) -> None:
    """Steps from now on read the placing thread's copies of cached weights (equal arrays; the file's mapping goes
    once nothing holds its views)."""
    leaves, self._copied_leaves = self._copied_leaves, None
    if leaves is not None:
      self._adopt(leaves)
