"""Tests of derived values and of the consistency checks between keys."""

import pytest

from maxtext.configs import ConfigError, load_config
from maxtext.configs.derived import kv_shared_sources, state_block_size

F, S, LIN = "full_attention", "sliding_attention", "linear_attention"


@pytest.mark.parametrize(
    "block, interval, window, expected",
    [
        ("llama2", 1, 0, (F,) * 6),
        ("qwen3", 3, 0, (F,) * 6),
        ("gemma3", 3, 4, (S, S, F, S, S, F)),
        ("qwen3_next", 4, 0, (LIN, LIN, LIN, F, LIN, LIN)),
        ("qwen3_5", 2, 0, (LIN, F, LIN, F, LIN, F)),
    ],
)
def test_layer_types_derived_from_family(block, interval, window, expected):
  cfg = load_config(
      decoder_block=block,
      base_num_decoder_layers=6,
      inhomogeneous_layer_cycle_interval=interval,
      sliding_window_size=window,
  )
  assert cfg.layer_types == expected


def test_explicit_layer_types_win():
  cfg = load_config(decoder_block="qwen3_next", base_num_decoder_layers=3, layer_types=[F, LIN, F])
  assert cfg.layer_types == (F, LIN, F)


def test_family_traits():
  llama = load_config(decoder_block="llama2")
  assert not (llama.use_qk_norm or llama.use_zero_centered_norm or llama.use_sandwich_norm)
  gemma = load_config(decoder_block="gemma3", sliding_window_size=4, query_pre_attn_scalar=24.0, head_dim=32)
  assert gemma.use_qk_norm and gemma.use_zero_centered_norm and gemma.use_sandwich_norm and gemma.use_embedding_scale
  assert gemma.attention_scale == pytest.approx(24.0**-0.5)
  nxt = load_config(decoder_block="qwen3_next", head_dim=32, partial_rotary_factor=0.25)
  assert nxt.use_attention_output_gate and nxt.rotary_dim == 8 and nxt.attention_scale == pytest.approx(32**-0.5)
  assert (
      nxt.gdn_conv_dim
      == 2 * nxt.gdn_num_key_heads * nxt.gdn_key_head_dim + nxt.gdn_num_value_heads * nxt.gdn_value_head_dim
  )
  qwen3 = load_config(decoder_block="qwen3")
  assert qwen3.use_qk_norm and not qwen3.use_zero_centered_norm and not qwen3.use_attention_output_gate


def test_moe_layers():
  cfg = load_config(
      decoder_block="qwen3_next",
      base_num_decoder_layers=6,
      num_experts=4,
      num_experts_per_tok=2,
      base_moe_mlp_dim=8,
      decoder_sparse_step=2,
      mlp_only_layers=[3],
  )
  assert cfg.moe_layers == (False, True, False, False, False, True)
  assert load_config().moe_layers == (False,) * load_config().base_num_decoder_layers


def test_kv_shared_sources_pick_last_earlier_layer_of_same_type():
  types = (S, F, S, S, F, S, F)
  assert kv_shared_sources(types, 0) == (-1,) * 7
  # Layers 4..6 are shared; the last non-shared sliding is 3, the last non-shared full is 1.
  assert kv_shared_sources(types, 3) == (-1, -1, -1, -1, 1, 3, 1)
  cfg = load_config(
      decoder_block="gemma3",
      base_num_decoder_layers=7,
      layer_types=list(types),
      sliding_window_size=4,
      num_kv_shared_layers=3,
  )
  assert cfg.kv_shared_source == (-1, -1, -1, -1, 1, 3, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"base_num_query_heads": 6, "base_num_kv_heads": 4},
            r"base_num_query_heads=6: must be divisible by base_num_kv_heads=4",
        ),
        (
            {"gdn_num_value_heads": 3, "gdn_num_key_heads": 2},
            r"gdn_num_value_heads=3: must be divisible by gdn_num_key_heads=2",
        ),
        (
            {"base_num_decoder_layers": 3, "layer_types": [F, F]},
            r"layer_types=\['full_attention', 'full_attention'\]: must have one entry per layer"
            r" \(base_num_decoder_layers=3\)",
        ),
        ({"base_num_decoder_layers": 2, "layer_types": [F, "rwkv"]}, r"entry 1 \('rwkv'\) must be one of"),
        (
            {"base_num_decoder_layers": 2, "layer_types": [F, LIN]},
            r"layer 1 is linear_attention, which needs decoder_block in qwen3_next, qwen3_5 \(got 'llama2'\)",
        ),
        (
            {"base_num_decoder_layers": 2, "layer_types": [F, S]},
            r"sliding_window_size=0: must be > 0 when there are sliding_attention layers",
        ),
        ({"decoder_block": "mamba"}, r"decoder_block='mamba': must be one of llama2, qwen3, gemma3, qwen3_next, qwen3_5"),
        ({"dtype": "float16"}, r"dtype='float16': must be one of float32, bfloat16"),
        ({"kv_cache_layout": "random"}, r"kv_cache_layout='random': must be one of layer, hybrid, shuffled"),
        ({"head_dim": 0}, r"head_dim=0: must be > 0"),
        ({"sliding_window_size": -1}, r"sliding_window_size=-1: must be >= 0"),
        ({"mlp_activations": ["relu", "linear"]}, r"mlp_activations=\['relu', 'linear'\]: must be"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5: must be in \(0, 1\]"),
        ({"head_dim": 12, "partial_rotary_factor": 0.25}, r"head_dim \* factor = 3 must be an even number"),
        ({"rope_scaling_factor": 0.0}, r"rope_scaling_factor=0.0: must be > 0"),
        ({"rope_max_timescale": 0.0}, r"rope_max_timescale=0.0: must be > 0"),
        (
            {"rope_type": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0},
            r"rope_high_freq_factor=1.0: must be > rope_low_freq_factor=4.0",
        ),
        (
            {"base_num_decoder_layers": 2, "num_kv_shared_layers": 2},
            r"num_kv_shared_layers=2: must be < base_num_decoder_layers=2",
        ),
        (
            {
                "base_num_decoder_layers": 2,
                "layer_types": [S, F],
                "sliding_window_size": 4,
                "decoder_block": "gemma3",
                "num_kv_shared_layers": 1,
            },
            r"KV-shared layer 1 \(full_attention\) needs an earlier non-shared full_attention layer",
        ),
        (
            {
                "decoder_block": "qwen3_next",
                "base_num_decoder_layers": 2,
                "layer_types": [F, LIN],
                "num_kv_shared_layers": 1,
            },
            r"layer 1 is linear_attention; only attention layers share K/V",
        ),
        (
            {"num_experts": 2, "num_experts_per_tok": 3, "base_moe_mlp_dim": 4},
            r"num_experts_per_tok=3: must be <= num_experts=2",
        ),
        ({"num_experts": 2, "num_experts_per_tok": 1}, r"base_moe_mlp_dim=0: must be > 0 when num_experts=2"),
        ({"base_num_decoder_layers": 2, "mlp_only_layers": [2]}, r"mlp_only_layers=\[2\]: layer 2 must be in \[0, 2\)"),
        (
            {"vocab_size": 10, "prompt_token_ids": [3, 10]},
            r"prompt_token_ids=\[3, 10\]: token 10 must be in \[0, vocab_size=10\)",
        ),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, r"max_num_batched_tokens=4: must be >= max_num_seqs=8"),
        ({"decode_sampling_nucleus_p": 1.5}, r"decode_sampling_nucleus_p=1.5: must be <= 1"),
        ({"decode_sampling_temperature": 2.5}, r"decode_sampling_temperature=2.5: must be <= 2"),
        (
            {"block_size": 16, "mamba_block_size": 24},
            r"mamba_block_size=24: must be 0 \(= block_size\) or a positive multiple of block_size=16",
        ),
        ({"mamba_block_size": -16}, r"mamba_block_size=-16: must be 0"),
        ({"min_token_bucket": 12}, r"min_token_bucket=12: must be a power of two"),
        ({"min_token_bucket": 0}, r"min_token_bucket=0"),
    ],
)
def test_inconsistent_combinations(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    load_config(**kwargs)


def test_state_block_size_defaults_to_the_block_size():
  assert state_block_size(load_config(block_size=8)) == 8
  assert state_block_size(load_config(block_size=8, mamba_block_size=32)) == 32
