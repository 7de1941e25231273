"""Tests of the Hugging Face config.json -> config key mapping."""

import json

import pytest

from maxtext.checkpoint import hf_config
from maxtext.configs import load_config

LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "mlp_bias": True,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": False,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [0],
    "full_attention_interval": 4,
    "rope_theta": 1e6,
    "partial_rotary_factor": 0.25,
}


def test_llama_legacy_rope_fields():
  out = hf_config.hf_config_to_overrides(LLAMA)
  assert out == {
      "decoder_block": "llama2",
      "base_emb_dim": 64,
      "base_num_decoder_layers": 2,
      "base_num_query_heads": 4,
      "base_num_kv_heads": 2,
      "head_dim": 16,
      "vocab_size": 512,
      "mlp_activations": ["silu", "linear"],
      "normalization_layer_epsilon": 1e-5,
      "logits_via_embedding": False,
      "attention_bias": True,
      "mlp_bias": True,
      "base_mlp_dim": 128,
      "layer_types": ["full_attention", "full_attention"],
      "rope_type": "llama3",
      "rope_scaling_factor": 8.0,
      "rope_low_freq_factor": 1.0,
      "rope_high_freq_factor": 4.0,
      "rope_original_max_position_embeddings": 64,
      "rope_max_timescale": 500000.0,
      "local_rope_max_timescale": 500000.0,
      "partial_rotary_factor": 1.0,
  }
  cfg = load_config(**out)
  assert cfg.rope_type == "llama3" and cfg.head_dim == 16


def test_llama_v5_rope_parameters_match_legacy():
  legacy = hf_config.hf_config_to_overrides(LLAMA)
  v5 = dict(LLAMA)
  scaling = dict(v5.pop("rope_scaling"))
  scaling["rope_theta"] = v5.pop("rope_theta")
  v5["rope_parameters"] = scaling
  assert hf_config.hf_config_to_overrides(v5) == legacy


def test_llama3_original_max_position_defaults_to_max_position_embeddings():
  raw = dict(LLAMA, max_position_embeddings=4096)
  raw["rope_scaling"] = {"type": "llama3", "factor": 2.0}
  out = hf_config.hf_config_to_overrides(raw)
  assert out["rope_original_max_position_embeddings"] == 4096
  assert (out["rope_low_freq_factor"], out["rope_high_freq_factor"], out["rope_scaling_factor"]) == (1.0, 4.0, 2.0)


def test_qwen3_next_moe_fields_and_derived_layer_types():
  out = hf_config.hf_config_to_overrides(QWEN3_NEXT)
  assert out["decoder_block"] == "qwen3_next"
  assert out["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
      "full_attention"
  ]
  assert out["inhomogeneous_layer_cycle_interval"] == 4
  assert (out["partial_rotary_factor"], out["rope_max_timescale"]) == (0.25, 1e6)
  assert {k: v for k, v in out.items() if k.startswith("gdn_")} == {
      "gdn_num_key_heads": 2,
      "gdn_num_value_heads": 4,
      "gdn_key_head_dim": 16,
      "gdn_value_head_dim": 24,
      "gdn_conv_kernel_dim": 4,
  }
  assert (out["num_experts"], out["num_experts_per_tok"], out["base_moe_mlp_dim"]) == (4, 2, 48)
  assert (out["shared_expert_mlp_dim"], out["norm_topk_prob"], out["decoder_sparse_step"]) == (64, False, 2)
  assert out["mlp_only_layers"] == [0]
  cfg = load_config(**out)
  assert cfg.moe_layers == (False, True, False, True, False, True, False, True)
  assert cfg.rotary_dim == 8


def test_qwen3_next_dense_has_no_moe_keys():
  out = hf_config.hf_config_to_overrides(dict(QWEN3_NEXT, num_experts=0))
  assert out["num_experts"] == 0
  assert "base_moe_mlp_dim" not in out and "num_experts_per_tok" not in out


def test_qwen3_5_moe_multimodal_uses_text_config_and_top_level_tie():
  text = {k: v for k, v in QWEN3_NEXT.items() if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
  text["model_type"] = "qwen3_5_moe_text"
  text["tie_word_embeddings"] = False
  text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10]}
  raw = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": text, "vision_config": {}}
  out = hf_config.hf_config_to_overrides(raw)
  assert out["decoder_block"] == "qwen3_5"
  assert out["logits_via_embedding"] is True
  assert (out["norm_topk_prob"], out["decoder_sparse_step"], out["mlp_only_layers"]) == (True, 1, [])
  # rope_parameters wins over the legacy top-level fields
  assert (out["rope_max_timescale"], out["partial_rotary_factor"]) == (1e7, 0.25)


def test_gemma3_multimodal_sparse_text_config_uses_class_defaults():
  # Hub gemma-3-4b style: text_config sets a few fields and relies on transformers' defaults for the rest.
  raw = {
      "model_type": "gemma3",
      "text_config": {
          "model_type": "gemma3_text",
          "hidden_size": 96,
          "num_hidden_layers": 7,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "sliding_window": 16,
      },
  }
  out = hf_config.hf_config_to_overrides(raw)
  assert out["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
  assert (out["sliding_window_size"], out["inhomogeneous_layer_cycle_interval"]) == (16, 6)
  assert (out["rope_type"], out["rope_scaling_factor"]) == ("linear", 8.0)
  assert (out["rope_max_timescale"], out["local_rope_max_timescale"]) == (1e6, 1e4)
  assert (out["vocab_size"], out["base_num_query_heads"], out["base_num_kv_heads"], out["head_dim"]) == (
      262208,
      8,
      4,
      256,
  )
  assert (out["query_pre_attn_scalar"], out["final_logits_soft_cap"]) == (256.0, 0.0)
  assert out["mlp_activations"] == ["gelu_tanh", "linear"]
  assert out["logits_via_embedding"] is True


def test_gemma3_nested_rope_parameters():
  raw = {
      "model_type": "gemma3_text",
      "num_hidden_layers": 4,
      "sliding_window_pattern": 2,
      "final_logit_softcapping": 30.0,
      "rope_parameters": {
          "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
          "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
      },
  }
  out = hf_config.hf_config_to_overrides(raw)
  assert out["layer_types"] == ["sliding_attention", "full_attention"] * 2
  assert out["inhomogeneous_layer_cycle_interval"] == 2
  assert (out["rope_type"], out["rope_scaling_factor"]) == ("linear", 4.0)
  assert (out["rope_max_timescale"], out["local_rope_max_timescale"]) == (5e5, 2e4)
  assert out["final_logits_soft_cap"] == 30.0


def test_gemma3_irregular_layer_types_keep_cycle_interval_one():
  raw = {
      "model_type": "gemma3_text",
      "num_hidden_layers": 3,
      "layer_types": ["full_attention", "sliding_attention", "full_attention"],
  }
  out = hf_config.hf_config_to_overrides(raw)
  assert out["inhomogeneous_layer_cycle_interval"] == 1
  assert load_config(**out).layer_types == ("full_attention", "sliding_attention", "full_attention")
  all_sliding = hf_config.hf_config_to_overrides(dict(raw, layer_types=["sliding_attention"] * 3))
  assert all_sliding["inhomogeneous_layer_cycle_interval"] == 1


def test_qwen3_sliding_window_layers_follow_max_window_layers():
  raw = {
      "model_type": "qwen3",
      "num_hidden_layers": 3,
      "use_sliding_window": True,
      "sliding_window": 8,
      "max_window_layers": 1,
  }
  out = hf_config.hf_config_to_overrides(raw)
  assert out["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
  assert out["sliding_window_size"] == 8
  plain = hf_config.hf_config_to_overrides({"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 8})
  assert plain["layer_types"] == ["full_attention"] * 2 and "sliding_window_size" not in plain


@pytest.mark.parametrize(
    "raw, error, match",
    [
        (
            {"model_type": "mistral"},
            NotImplementedError,
            r"model_type 'mistral' is not supported \(supported: bamba, gemma3,",
        ),
        ({}, NotImplementedError, r"model_type None is not supported"),
        ({"model_type": "gemma3"}, ValueError, r"multimodal model_type 'gemma3' must have a text_config"),
        (
            {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_next"}},
            NotImplementedError,
            r"text_config.model_type 'qwen3_next' of a 'qwen3_5' model is not supported \(expected 'qwen3_5_text'\)",
        ),
        (
            dict(LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
            NotImplementedError,
            r"rope type 'dynamic' \(rope_parameters\) of Hugging Face model_type 'llama' is not supported "
            r"\(supported: default, linear, llama3, yarn\)",
        ),
        (
            {"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2}}},
            NotImplementedError,
            r"rope type 'linear' on sliding_attention layers",
        ),
        (
            {"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2}}},
            NotImplementedError,
            r"rope type 'dynamic' \(rope_parameters.full_attention\)",
        ),
        (
            dict(LLAMA, hidden_act="relu"),
            NotImplementedError,
            r"activation hidden_act='relu' of Hugging Face model_type 'llama'",
        ),
        (dict(LLAMA, vocab_size=None), ValueError, r"\(llama\) must set 'vocab_size'; it is missing or null"),
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            NotImplementedError,
            r"use_bidirectional_attention=true",
        ),
        (
            dict(QWEN3_NEXT, attention_bias=True),
            NotImplementedError,
            r"attention_bias=true of Hugging Face model_type 'qwen3_next'",
        ),
        (
            dict(QWEN3_NEXT, layer_types=["full_attention"] * 7),
            ValueError,
            r"layer_types must list 8 entries from \('full_attention', 'sliding_attention', 'linear_attention'\)",
        ),
        (dict(QWEN3_NEXT, layer_types=["mamba"] * 8), ValueError, r"layer_types must list 8 entries"),
    ],
)
def test_unsupported_or_invalid_configs(raw, error, match):
  with pytest.raises(error, match=match):
    hf_config.hf_config_to_overrides(raw)


def test_read_hf_config(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"folder '.*nope' does not exist"):
    hf_config.read_hf_config(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match=r"has no config.json"):
    hf_config.read_hf_config(tmp_path)
  (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
  with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
    hf_config.read_hf_config(tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]", encoding="utf-8")
  with pytest.raises(ValueError, match=r"must hold a JSON object, got list"):
    hf_config.read_hf_config(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
  assert hf_config.read_hf_config(tmp_path) == LLAMA
  assert hf_config.read_hf_config(tmp_path / "config.json") == LLAMA


def _hf_config(model_type, **kwargs):
  """A transformers config object (imported lazily: transformers is the optional hf extra)."""
  # pylint: disable=import-outside-toplevel  # transformers is an optional test dependency (hf marker)
  import transformers

  return transformers.AutoConfig.for_model(model_type, **kwargs)


def _hf_configs():
  small = {"num_hidden_layers": 12}
  llama3 = {
      "rope_type": "llama3",
      "rope_theta": 5e5,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024,
  }
  return [
      _hf_config("llama", **small, rope_parameters=llama3),
      _hf_config("qwen3", **small, tie_word_embeddings=True, attention_bias=True),
      _hf_config("gemma3_text", **small, sliding_window=32),
      _hf_config("gemma3", text_config=dict(small, rope_scaling={"rope_type": "linear", "factor": 8.0})),
      _hf_config("qwen3_next", **small, mlp_only_layers=[1], decoder_sparse_step=2),
      _hf_config("qwen3_5_text", **small),
      _hf_config("qwen3_5", text_config=small),
      _hf_config("qwen3_5_moe_text", **small),
      _hf_config("qwen3_5_moe", text_config=small),
  ]


@pytest.mark.hf
def test_mapping_agrees_with_transformers_config_objects():
  for hf in _hf_configs():
    text = hf.get_text_config()
    out = hf_config.hf_config_to_overrides(json.loads(hf.to_json_string()))
    cfg = load_config(**out)
    expected_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    assert cfg.layer_types == tuple(expected_types), hf.model_type
    assert cfg.base_num_decoder_layers == text.num_hidden_layers
    assert (cfg.base_emb_dim, cfg.vocab_size, cfg.head_dim) == (text.hidden_size, text.vocab_size, text.head_dim)
    assert cfg.base_num_kv_heads == text.num_key_value_heads
    rope = text.rope_parameters.get("full_attention", text.rope_parameters)
    assert cfg.rope_max_timescale == rope["rope_theta"], hf.model_type
    assert cfg.rope_type == rope["rope_type"], hf.model_type
    assert cfg.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)
    assert cfg.logits_via_embedding == hf.tie_word_embeddings
    if getattr(text, "num_experts", 0):
      mlp_only = set(getattr(text, "mlp_only_layers", []))
      step = getattr(text, "decoder_sparse_step", 1)
      expected = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(text.num_hidden_layers))
      assert cfg.moe_layers == expected


@pytest.mark.hf
def test_legacy_hub_fields_derive_like_transformers():
  gemma = {
      "model_type": "gemma3_text",
      "num_hidden_layers": 8,
      "sliding_window_pattern": 3,
      "rope_theta": 2e6,
      "rope_local_base_freq": 5e4,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0},
  }
  hf = _hf_config(**gemma)
  out = load_config(**hf_config.hf_config_to_overrides(gemma))
  assert out.layer_types == tuple(hf.layer_types)
  assert out.rope_max_timescale == hf.rope_parameters["full_attention"]["rope_theta"]
  assert out.local_rope_max_timescale == hf.rope_parameters["sliding_attention"]["rope_theta"]
  assert (out.rope_type, out.rope_scaling_factor) == ("linear", hf.rope_parameters["full_attention"]["factor"])
  nxt = {
      "model_type": "qwen3_next",
      "num_hidden_layers": 6,
      "full_attention_interval": 3,
      "rope_theta": 3e6,
      "partial_rotary_factor": 0.5,
  }
  hf = _hf_config(**nxt)
  out = load_config(**hf_config.hf_config_to_overrides(nxt))
  assert out.layer_types == tuple(hf.layer_types)
  assert (out.rope_max_timescale, out.partial_rotary_factor) == (
      hf.rope_parameters["rope_theta"],
      hf.rope_parameters["partial_rotary_factor"],
  )
