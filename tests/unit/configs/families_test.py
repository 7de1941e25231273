"""The family registry: every decoder_block is one registered family, and each family's Hugging Face mapping maps
back to it."""

import dataclasses

import pytest

from maxtext.checkpoint import hf_config
from maxtext.configs import ConfigError, available_models, families, load_config
from maxtext.configs.derived import DECODER_BLOCKS
from maxtext.configs.families import Family, HFMapping, TensorLayout, Traits
from maxtext.configs.families.hf_fields import HFFields, cycle_interval, given_layer_types, json_float
from maxtext.layers.mixer import get_mixer_class
from maxtext.models.decoder_layer import FEED_FORWARD_LAYOUTS

_ALL_TEXT_TYPES = [(f.name, t) for f in families.families() for t in f.hf.model_types]


def _layer_types(fields: HFFields, num_layers: int) -> list[str]:
  del fields  # every layer is full attention
  return ["full_attention"] * num_layers


def _family(name: str, **kwargs) -> Family:
  hf = kwargs.pop("hf", HFMapping(model_types={f"{name}_type": {}}, layer_types=_layer_types))
  return Family(name=name, hf=hf, **kwargs)


def test_unknown_family_names_the_known_blocks():
  with pytest.raises(ConfigError, match=r"decoder_block='mistral': must be one of llama2, qwen3, gemma3, .*bamba"):
    families.get_family("mistral")
  with pytest.raises(ConfigError, match="decoder_block=None"):
    families.get_family(None)


def test_every_decoder_block_is_a_registered_family():
  assert DECODER_BLOCKS == families.DECODER_BLOCKS
  assert [f.name for f in families.families()] == list(DECODER_BLOCKS)
  assert set(DECODER_BLOCKS) == {
      "llama2",
      "qwen3",
      "gemma3",
      "qwen3_next",
      "qwen3_5",
      "gpt_oss",
      "granite_hybrid",
      "bamba",
  }
  for block in DECODER_BLOCKS:
    assert families.get_family(block).name == block


@pytest.mark.parametrize("model_name", available_models())
def test_every_model_yml_names_a_registered_family(model_name):
  block = load_config(model_name=model_name).decoder_block
  assert families.get_family(block).name == block


def test_a_wrong_decoder_block_in_a_config_is_rejected_naming_the_families():
  with pytest.raises(ConfigError, match="decoder_block='nope': must be one of llama2, qwen3"):
    load_config(decoder_block="nope")


@pytest.mark.parametrize("block, model_type", _ALL_TEXT_TYPES)
def test_hf_mapping_round_trip(block, model_type):
  """A config.json with only its model_type (every field at the transformers default) maps to the family, and the
  loaded config's layer kinds and traits are the family's."""
  family = families.get_family(block)
  overrides = hf_config.hf_config_to_overrides({"model_type": model_type})
  assert overrides["decoder_block"] == block
  assert families.family_of_hf_model_type(model_type) is family
  cfg = load_config(**overrides)
  assert list(cfg.layer_types) == overrides["layer_types"]
  for name, value in dataclasses.asdict(family.traits).items():
    assert cfg[f"use_{name}"] is value, name
  kinds = set(cfg.layer_types) - {"full_attention"}
  assert kinds <= {family.cycle_kind} | ({"sliding_attention"} if block == "qwen3" else set())


@pytest.mark.parametrize("wrapper, text_type", sorted(families.hf_multimodal_model_types().items()))
def test_multimodal_wrappers_map_to_the_family_of_their_text_config(wrapper, text_type):
  overrides = hf_config.hf_config_to_overrides({"model_type": wrapper, "text_config": {}})
  assert overrides["decoder_block"] == families.family_of_hf_model_type(text_type).name
  assert families.family_of_hf_model_type(wrapper) is families.family_of_hf_model_type(text_type)


def test_unknown_hf_model_type_names_the_supported_ones():
  assert families.family_of_hf_model_type("mistral") is None
  with pytest.raises(NotImplementedError, match="model_type 'mistral' is not supported .*bamba.*qwen3_5_moe_text"):
    hf_config.hf_config_to_overrides({"model_type": "mistral"})


@pytest.mark.parametrize("family", families.families(), ids=lambda f: f.name)
def test_default_layer_pattern_is_the_family_cycle(family):
  cfg = load_config(
      **{
          "decoder_block": family.name,
          "base_num_decoder_layers": 4,
          "inhomogeneous_layer_cycle_interval": 2,
          "sliding_window_size": 8,
          **({"num_experts": 4, "base_moe_mlp_dim": 8, "num_experts_per_tok": 2} if family.check else {}),
      }
  )
  other = family.cycle_kind or "full_attention"
  assert cfg.layer_types == (other, "full_attention", other, "full_attention")


@pytest.mark.parametrize("family", families.families(), ids=lambda f: f.name)
def test_each_family_names_layouts_the_layers_declare(family):
  assert family.tensors.ffn in FEED_FORWARD_LAYOUTS
  for kind in family.owned_kinds:
    assert get_mixer_class(kind).layer_types


def test_owned_kinds_name_their_families():
  assert families.kind_owners("linear_attention") == ("qwen3_next", "qwen3_5")
  assert families.kind_owners("mamba") == ("granite_hybrid", "bamba")
  assert not families.kind_owners("sliding_attention")
  with pytest.raises(ConfigError, match=r"layer 1 is mamba, which needs decoder_block in granite_hybrid, bamba"):
    load_config(base_num_decoder_layers=2, layer_types=["full_attention", "mamba"])


def test_gguf_architectures_come_from_the_families():
  assert families.gguf_architectures() == ("gemma3", "llama", "qwen3")
  assert families.gguf_mapping("llama").permuted_rope_rows
  assert not families.gguf_mapping("qwen3").permuted_rope_rows
  assert families.gguf_mapping("qwen3").model_type in families.get_family("qwen3").hf.model_types
  assert families.gguf_mapping("gemma3").model_type in families.get_family("gemma3").hf.model_types
  assert families.gguf_mapping("gemma3").norm_shift == 1.0 and not families.gguf_mapping("gemma3").permuted_rope_rows
  assert families.gguf_mapping("gemma2") is None


def test_registry_rejects_two_families_claiming_one_name_or_model_type():
  with pytest.raises(ValueError, match="decoder_block 'a' is registered twice"):
    families.build_registry([_family("a"), _family("a")])
  with pytest.raises(ValueError, match="model_type 'a_type' belongs to both 'a' and 'b'"):
    families.build_registry([_family("a"), _family("b", hf=HFMapping({"a_type": {}}, _layer_types))])
  with pytest.raises(TypeError, match="holds Family records, got str"):
    families.build_registry(["llama2"])
  assert list(families.build_registry([_family("a"), _family("b")])) == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensors": TensorLayout(ffn="dense")}, "tensors.ffn must be one of"),
        ({"tensors": TensorLayout(gdn_projections="fused")}, "tensors.gdn_projections must be one of"),
        ({"hf": HFMapping(model_types={}, layer_types=_layer_types)}, "must name at least one Hugging Face"),
    ],
)
def test_family_record_rejects_unknown_layouts(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _family("x", **kwargs)


def test_traits_default_to_off():
  assert not any(dataclasses.asdict(Traits()).values())


def test_hf_field_helpers():
  fields = HFFields({"a": None, "layer_types": ["full_attention", "mamba"]}, "t", {"b": 2})
  assert fields.get("a") is None and fields.get("b") == 2 and fields.get("rms_norm_eps") == 1e-6
  with pytest.raises(ValueError, match=r"\(t\) must set 'a'"):
    fields.require("a")
  with pytest.raises(ValueError, match="layer_types must list 2 entries"):
    given_layer_types(fields, 2)
  assert cycle_interval(["sliding_attention", "full_attention"] * 2, "sliding_attention") == 2
  assert cycle_interval(["full_attention", "sliding_attention"], "sliding_attention") == 1
  assert json_float({"__float__": "Infinity"}, "k") == float("inf")
  with pytest.raises(ValueError, match="k must hold numbers"):
    json_float("x", "k")


def test_a_registered_family_joins_the_registry_and_a_claimed_name_is_refused():
  before = list(DECODER_BLOCKS)
  qwen3 = families.get_family("qwen3")
  assert families.register_family(qwen3) is qwen3  # the same record again: nothing changes
  with pytest.raises(ValueError, match="decoder_block 'qwen3' is registered twice"):
    families.register_family(dataclasses.replace(qwen3))
  with pytest.raises(ValueError, match="Hugging Face model_type 'qwen3' belongs to both 'qwen3' and 'qwen3_copy'"):
    families.register_family(dataclasses.replace(qwen3, name="qwen3_copy"))
  assert list(DECODER_BLOCKS) == before and len(DECODER_BLOCKS) == len(before)
  assert "qwen3" in DECODER_BLOCKS and "qwen3_copy" not in DECODER_BLOCKS and DECODER_BLOCKS[0] == before[0]
  assert repr(DECODER_BLOCKS) == repr(tuple(before))
