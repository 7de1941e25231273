"""The layer kinds a config may name in `layer_types`, and the config rules each kind brings.

A layer kind is a name (`full_attention`, `sliding_attention`, `linear_attention`, `mamba`, ...), the kind of cache its
layers ask the runner for (`attention`: paged KV blocks addressed by block tables; `recurrent`: one state slot per
request), and an optional check of the config keys it reads. The four built-in kinds are declared here, below
every model module, so a config can be validated without importing a model. Which families may name a kind is
the families' to say (`Family.owned_kinds` in `maxtext.configs.families`). A new kind is declared by
`maxtext.layers.mixer.register_mixer`, which calls `register_layer_kind` with the mixer class's name, cache kind and
config check: one registry call, nothing else to edit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from maxtext.configs.errors import ConfigError

ATTENTION_CACHE = "attention"
RECURRENT_CACHE = "recurrent"
CACHE_KINDS = (ATTENTION_CACHE, RECURRENT_CACHE)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
MAMBA = "mamba"

# check(values, layer_index) raises ConfigError (naming the config key, the value and what must hold) when the
# config does not suit layer `layer_index` of this kind.
ConfigCheck = Callable[[Mapping[str, Any], int], None]


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One `layer_types` name.

  Attributes:
    name: the name in `layer_types`.
    cache_kind: `attention` (paged KV cache, can be KV-shared) or `recurrent` (a per-request state slot).
    check: the kind's config rule, or None.
  """

  name: str
  cache_kind: str
  check: ConfigCheck | None = None


def _check_sliding(values: Mapping[str, Any], _: int) -> None:
  if values["sliding_window_size"] <= 0:
    raise ConfigError(
        f"sliding_window_size={values['sliding_window_size']!r}: must be > 0 when there are sliding_attention layers"
    )


_KINDS: dict[str, LayerKind] = {
    FULL_ATTENTION: LayerKind(FULL_ATTENTION, ATTENTION_CACHE),
    SLIDING_ATTENTION: LayerKind(SLIDING_ATTENTION, ATTENTION_CACHE, _check_sliding),
    LINEAR_ATTENTION: LayerKind(LINEAR_ATTENTION, RECURRENT_CACHE),
    MAMBA: LayerKind(MAMBA, RECURRENT_CACHE),
}


def register_layer_kind(kind: LayerKind) -> None:
  """Declares a layer kind (idempotent for an identical declaration).

  Raises:
    TypeError: `kind` is not a LayerKind.
    ValueError: an empty name, an unknown cache kind, or a name already declared differently.
  """
  if not isinstance(kind, LayerKind):
    raise TypeError(f"register_layer_kind takes a LayerKind, got {type(kind).__name__}")
  if not isinstance(kind.name, str) or not kind.name or kind.name != kind.name.strip():
    raise ValueError(f"a layer kind name must be a non-empty string without surrounding spaces, got {kind.name!r}")
  if kind.cache_kind not in CACHE_KINDS:
    raise ValueError(
        f"layer kind {kind.name!r}: cache_kind must be one of {', '.join(CACHE_KINDS)}, got {kind.cache_kind!r}"
    )
  known = _KINDS.get(kind.name)
  if known is not None and known.cache_kind != kind.cache_kind:
    raise ValueError(
        f"layer kind {kind.name!r} is already declared with cache_kind {known.cache_kind!r}; cannot redeclare it"
        f" with {kind.cache_kind!r}"
    )
  if known is None or kind.check is not None:
    _KINDS[kind.name] = kind


def get_layer_kind(name: str) -> LayerKind | None:
  """The declared kind of that name, or None."""
  return _KINDS.get(name) if isinstance(name, str) else None


def layer_kind_names() -> tuple[str, ...]:
  """Every declared kind, sorted."""
  return tuple(sorted(_KINDS))


def is_attention_kind(name: str) -> bool:
  """Whether layers of this kind use a paged attention cache (and so may share K/V)."""
  kind = get_layer_kind(name)
  return kind is not None and kind.cache_kind == ATTENTION_CACHE
