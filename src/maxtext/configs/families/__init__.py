"""The model families, one module per `decoder_block`, and the registry every other module asks about them.

    family = get_family(cfg.decoder_block)          # traits, default layer pattern, checkpoint layout
    family = family_of_hf_model_type("qwen3_5_moe_text")

A new family is a module here defining `FAMILY = Family(...)` (see `family.py`) and one entry in `_MODULES`; a
module outside the package (a plugin, a test) registers its record with `register_family`. docs/architecture.md
walks through one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from maxtext.configs.errors import ConfigError
from maxtext.configs.families import bamba, gemma3, gpt_oss, granite_hybrid, llama2, qwen3, qwen3_5, qwen3_next
from maxtext.configs.families.family import Family, GGUFMapping, HFMapping, TensorLayout, Traits

# Registration order is the order the config error lists the decoder blocks in.
_MODULES = (llama2, qwen3, gemma3, qwen3_next, qwen3_5, gpt_oss, granite_hybrid, bamba)


def build_registry(members: Sequence[Family]) -> dict[str, Family]:
  """`{decoder_block: family}` of `members`, checking that no name, Hugging Face model_type or GGUF architecture
  belongs to two families.

  Raises:
    TypeError: a member is not a Family.
    ValueError: naming what two families both claim.
  """
  registry: dict[str, Family] = {}
  hf_types: dict[str, str] = {}
  gguf_archs: dict[str, str] = {}
  for family in members:
    if not isinstance(family, Family):
      raise TypeError(f"a family registry holds Family records, got {type(family).__name__}")
    if family.name in registry:
      raise ValueError(f"decoder_block {family.name!r} is registered twice")
    registry[family.name] = family
    for model_type in (*family.hf.model_types, *family.hf.multimodal_types):
      if model_type in hf_types:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} belongs to both {hf_types[model_type]!r} and {family.name!r}"
        )
      hf_types[model_type] = family.name
    for gguf in family.gguf:
      if gguf.architecture in gguf_archs:
        raise ValueError(
            f"GGUF architecture {gguf.architecture!r} belongs to both {gguf_archs[gguf.architecture]!r} and"
            f" {family.name!r}"
        )
      gguf_archs[gguf.architecture] = family.name
  return registry


_FAMILIES = build_registry([module.FAMILY for module in _MODULES])


class _DecoderBlocks(Sequence[str]):
  """The registered decoder_block names in registration order, read when asked: a family registered after import
  (`register_family`) is among them."""

  def __getitem__(self, index):
    return tuple(_FAMILIES)[index]

  def __len__(self) -> int:
    return len(_FAMILIES)

  def __iter__(self) -> Iterator[str]:
    return iter(tuple(_FAMILIES))

  def __contains__(self, name: object) -> bool:
    return name in _FAMILIES

  def __repr__(self) -> str:
    return repr(tuple(_FAMILIES))


DECODER_BLOCKS: Sequence[str] = _DecoderBlocks()


def register_family(family: Family) -> Family:
  """Adds a family defined outside this package to the registry, after the built-in ones (idempotent for the same
  record). Its module calls it at import; importing that module before the config is loaded is all it takes.

  Returns:
    `family`.

  Raises:
    TypeError, ValueError: as `build_registry`, e.g. a name or Hugging Face model_type another family has.
  """
  if _FAMILIES.get(getattr(family, "name", None)) is family:
    return family
  registry = build_registry([*_FAMILIES.values(), family])
  _FAMILIES.clear()
  _FAMILIES.update(registry)
  return family


def get_family(decoder_block: str) -> Family:
  """The family registered under `decoder_block`.

  Raises:
    ConfigError: no family of that name (naming the known ones).
  """
  family = _FAMILIES.get(decoder_block) if isinstance(decoder_block, str) else None
  if family is None:
    raise ConfigError(f"decoder_block={decoder_block!r}: must be one of {', '.join(DECODER_BLOCKS)}")
  return family


def families() -> tuple[Family, ...]:
  """Every registered family, in registration order."""
  return tuple(_FAMILIES.values())


def family_of_hf_model_type(model_type: str) -> Family | None:
  """The family whose Hugging Face mapping names `model_type` (a text or multimodal type), or None."""
  for family in _FAMILIES.values():
    if model_type in family.hf.model_types or model_type in family.hf.multimodal_types:
      return family
  return None


def hf_text_model_types() -> tuple[str, ...]:
  """Every text `model_type` a family maps."""
  return tuple(t for family in _FAMILIES.values() for t in family.hf.model_types)


def hf_multimodal_model_types() -> dict[str, str]:
  """Every multimodal wrapper `model_type` -> the model_type of its text_config."""
  return {k: v for family in _FAMILIES.values() for k, v in family.hf.multimodal_types.items()}


def gguf_mapping(architecture: str) -> GGUFMapping | None:
  """The GGUF mapping of a `general.architecture`, or None."""
  for family in _FAMILIES.values():
    for gguf in family.gguf:
      if gguf.architecture == architecture:
        return gguf
  return None


def gguf_architectures() -> tuple[str, ...]:
  """Every GGUF architecture a family is read from, sorted."""
  return tuple(sorted(g.architecture for family in _FAMILIES.values() for g in family.gguf))


def kind_owners(kind: str) -> tuple[str, ...]:
  """The decoder blocks that own layer kind `kind` (empty: any family may name it)."""
  return tuple(family.name for family in _FAMILIES.values() if kind in family.owned_kinds)


__all__ = [
    "DECODER_BLOCKS",
    "Family",
    "GGUFMapping",
    "HFMapping",
    "TensorLayout",
    "Traits",
    "build_registry",
    "families",
    "family_of_hf_model_type",
    "get_family",
    "gguf_architectures",
    "gguf_mapping",
    "hf_multimodal_model_types",
    "hf_text_model_types",
    "kind_owners",
    "register_family",
]
