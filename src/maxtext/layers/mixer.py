"""The mixer protocol: what one layer kind (attention, Gated DeltaNet, ...) owns, and the registry of kinds.

A decoder layer is `norm -> mixer -> norm -> MLP/MoE`; everything that differs between layer kinds lives in the
mixer class of the kind:
  - `layer_types`: the `layer_types` names it answers to, and `cache_kind` (`attention` or `recurrent`);
  - `param_name`: the attribute of the decoder layer that holds it, which is also its checkpoint prefix
    (`layers.{i}.<param_name>.*`);
  - `from_config(cfg, layer_index, rngs=)`: build it from the config;
  - `paged(x, positions, cache, md, backend)`: the runner-path forward over its own cache and metadata, reaching
    kernels only through the kernel backend;
  - `cache_spec(cfg, layer_index)`: the cache it asks the runner for, whose `validate(name, cache, slot)` checks
    the slot it is handed;
  - `declare(cfg, layer_index, stored)`: its parameters (`declarations.ParamDecl`), each with its logical axes and
    the Hugging Face tensors that fill it (named relative to the decoder layer's `model.layers.{i}.`).
A mixer may also define `__call__(x, positions, shared_kv, chunked=)`, the dense full-sequence forward. It is not
part of the protocol: the runner and vLLM only call `paged`; the tests' dense reference (`Transformer.__call__`)
calls it, and raises `NotImplementedError` for a kind without one.
`register_mixer(cls)` declares the class's names as layer kinds (so configs accept them) and makes the model, the
cache specs, the shardings, the checkpoint mapping and the reference runner use it. Adding a kind is one module
with one such class and one `register_mixer` call, plus its config keys; docs/architecture.md walks through one.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import ml_collections
from flax import nnx

from maxtext.configs import layer_kinds
from maxtext.configs.errors import ConfigError

KV = tuple[jax.Array, jax.Array]


class Mixer(nnx.Module):
  """Base class of every layer kind's token mixer.

  A subclass sets the three class attributes and defines the methods of the protocol (see the module docstring;
  `register_mixer` checks they are there):

      @classmethod
      def from_config(cls, cfg, layer_index: int, *, rngs: nnx.Rngs) -> Mixer
      @classmethod
      def cache_spec(cls, cfg, layer_index: int) -> AttentionSpec | RecurrentSpec
      @classmethod
      def declare(cls, cfg, layer_index: int, stored=()) -> list[ParamDecl]
      def paged(self, x [T, D], positions [T], cache, md, backend) -> (y [T, D], cache after the step)

  and, optionally, the dense forward the tests compare `paged` with:

      def __call__(self, x [B, T, D], positions [B, T], shared_kv=None, *, chunked=True) -> (y [B, T, D], kv | None)

  `shared_kv` is the source layer's K/V for KV-sharing attention layers (others raise if given one); `chunked`
  picks the full-sequence form of recurrent kinds.
  """

  layer_types: ClassVar[tuple[str, ...]] = ()
  cache_kind: ClassVar[str] = ""
  param_name: ClassVar[str] = ""

  def __call__(  # pylint: disable=arguments-differ  # nnx call hook
      self, x: jax.Array, positions: jax.Array, shared_kv: KV | None = None, *, chunked: bool = True
  ) -> tuple[jax.Array, KV | None]:
    """The dense full-sequence forward, which a kind may leave out (see the class docstring).

    Raises:
      NotImplementedError: this kind has none.
    """
    del x, positions, shared_kv, chunked
    raise NotImplementedError(
        f"{type(self).__name__} has no dense full-sequence forward (__call__); the runner path is paged(), and only"
        " the tests' dense reference (Transformer.__call__) needs __call__"
    )


_MIXERS: dict[str, type[Mixer]] = {}
PROTOCOL_METHODS = ("from_config", "cache_spec", "declare", "paged")


def register_mixer(cls: type[Mixer]) -> type[Mixer]:
  """Registers a mixer class for each of its `layer_types` (usable as a class decorator; idempotent).

  Raises:
    TypeError: `cls` is not a Mixer subclass.
    ValueError: it declares no layer type, no or an unknown cache kind, no `param_name`, a name another class
      already answers to, or a name declared as a layer kind of the other cache kind.
  """
  if not (isinstance(cls, type) and issubclass(cls, Mixer)):
    raise TypeError(f"register_mixer takes a Mixer subclass, got {cls!r}")
  if not cls.layer_types or not all(isinstance(n, str) and n for n in cls.layer_types):
    raise ValueError(f"{cls.__name__}.layer_types must name at least one layer kind, got {cls.layer_types!r}")
  if cls.cache_kind not in layer_kinds.CACHE_KINDS:
    raise ValueError(
        f"{cls.__name__}.cache_kind must be one of {', '.join(layer_kinds.CACHE_KINDS)}, got {cls.cache_kind!r}"
    )
  missing = [m for m in PROTOCOL_METHODS if not any(m in vars(base) for base in cls.__mro__[: cls.__mro__.index(Mixer)])]
  if missing:
    raise ValueError(f"{cls.__name__} must define {', '.join(missing)} (the mixer protocol)")
  if not cls.param_name.isidentifier():
    raise ValueError(f"{cls.__name__}.param_name must be an identifier (the parameter prefix), got {cls.param_name!r}")
  for name in cls.layer_types:
    known = _MIXERS.get(name)
    if known is not None and known is not cls:
      raise ValueError(f"layer kind {name!r} already has the mixer {known.__name__}; cannot register {cls.__name__}")
  for name in cls.layer_types:
    layer_kinds.register_layer_kind(layer_kinds.LayerKind(name, cls.cache_kind))
    _MIXERS[name] = cls
  return cls


def get_mixer_class(layer_type: str, layer_index: int | None = None) -> type[Mixer]:
  """The mixer class of a `layer_types` name.

  Raises:
    ConfigError: no mixer is registered for that name (naming the layer and the registered kinds).
  """
  if layer_type not in _MIXERS:
    where = f"layer_types[{layer_index}]" if layer_index is not None else "layer_types entry"
    raise ConfigError(
        f"{where}={layer_type!r} has no registered mixer (registered: {', '.join(registered_layer_types())})"
    )
  return _MIXERS[layer_type]


def registered_layer_types() -> tuple[str, ...]:
  """Every layer type a mixer answers to, sorted."""
  return tuple(sorted(_MIXERS))


def layer_mixer_class(cfg: ml_collections.FrozenConfigDict, layer_index: int) -> type[Mixer]:
  """The mixer class of layer `layer_index` of `cfg`."""
  return get_mixer_class(cfg.layer_types[layer_index], layer_index)
