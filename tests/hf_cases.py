"""Tiny random Hugging Face models of every supported family, as transformers builds them.

`build_hf_model(case)` makes the float32 model of `CASES[case]` (seeded) and adds seeded noise to every 1-D
parameter and every `*_bias` (norm weights, A_log, dt_bias, biases, sinks, gpt-oss expert biases: transformers
initialises (1+w) norm weights and biases to exactly 0). Sizes are those of the families' tiny configs. Used by the
checkpoint tests and by the upstream tier's references (tests/upstream/references.py). Needs torch and
transformers.
"""

from typing import Any

LIN, FULL, SLIDE = "linear_attention", "full_attention", "sliding_attention"
_GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
}
_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.05,
}
_GEMMA3_5TO1 = dict(
    _COMMON,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=12,
    layer_types=[SLIDE] * 5 + [FULL] + [SLIDE] * 5 + [FULL],
    sliding_window=1024,
    query_pre_attn_scalar=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
_HYBRID = dict(_COMMON, **_GDN, num_hidden_layers=8, layer_types=[LIN, LIN, LIN, FULL] * 2)
_HYBRID_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64}

_MAMBA = {
    "mamba_n_heads": 8,
    "mamba_d_head": "auto",  # 2 * 64 / 8 = 16
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
}
_GRANITE = dict(
    _COMMON,
    **_MAMBA,
    num_hidden_layers=4,
    head_dim=16,
    mamba_n_groups=2,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.125,
    logits_scaling=4.0,
    tie_word_embeddings=True,
)

# case name -> (transformers model_type, config kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "llama",
        dict(
            _COMMON,
            num_hidden_layers=3,
            initializer_range=0.2,
            rms_norm_eps=1e-5,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            max_position_embeddings=256,
        ),
    ),
    "qwen3_tied": (
        "qwen3",
        dict(_COMMON, num_hidden_layers=3, initializer_range=0.2, attention_bias=True, tie_word_embeddings=True),
    ),
    "qwen3_untied": ("qwen3", dict(_COMMON, num_hidden_layers=2, initializer_range=0.2, tie_word_embeddings=False)),
    "gemma3": (
        "gemma3_text",
        dict(
            _COMMON,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=6,
            layer_types=[SLIDE, SLIDE, FULL] * 2,
            sliding_window=16,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    # Gemma3's realistic pattern and window (5 sliding : 1 full, window 1024, as gemma3-4b) on tiny dimensions.
    "gemma3_5to1": ("gemma3_text", _GEMMA3_5TO1),
    # The 5:1 pattern with a short window, for the allocator's end-to-end measurement at 4k context
    # (tests/upstream/allocator_test.py): a sliding layer keeps about window / block_size blocks of a request.
    "gemma3_allocator": (
        "gemma3_text",
        dict(_GEMMA3_5TO1, sliding_window=128, max_position_embeddings=4096),
    ),
    # What a Gemma 3 GGUF file can describe (llama.cpp fixes 5 sliding : 1 full, the query scale 1/sqrt(head_dim) and
    # the sliding RoPE base 1e4), with linear RoPE scaling on the full layers and a window of 5.
    "gemma3_gguf": (
        "gemma3_text",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=6,
            layer_types=[SLIDE] * 5 + [FULL],
            sliding_window=5,
            query_pre_attn_scalar=32,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma3_softcap": (
        "gemma3_text",
        dict(
            _COMMON,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=4,
            layer_types=[SLIDE, FULL, SLIDE, FULL],
            sliding_window=3,
            query_pre_attn_scalar=24,
            final_logit_softcapping=2.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_next_moe": (
        "qwen3_next",
        dict(_HYBRID, **_MOE, norm_topk_prob=False, mlp_only_layers=[1], rope_parameters=_HYBRID_ROPE),
    ),
    "qwen3_next_dense": ("qwen3_next", dict(_HYBRID, num_experts=0, rope_parameters=_HYBRID_ROPE)),
    "qwen3_5": ("qwen3_5_text", dict(_HYBRID, rope_parameters=_HYBRID_ROPE)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_HYBRID, **_MOE, rope_parameters=_HYBRID_ROPE)),
    # Granite 4.0 MoE with RoPE, legacy layer type names, a time-step clamp that binds, and projection biases.
    "granite_moe": (
        "granitemoehybrid",
        dict(
            _GRANITE,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=64,
            attention_bias=True,
            mamba_proj_bias=True,
            time_step_limit=(0.05, 2.0),
        ),
    ),
    # Granite 4.0 dense (no experts: the shared MLP is the MLP) without RoPE, transformers 5 layer type names.
    "granite_dense": (
        "granitemoehybrid",
        dict(
            _GRANITE,
            layer_types=[LIN, LIN, FULL, LIN],
            num_local_experts=0,
            shared_intermediate_size=128,
            mamba_conv_bias=False,
        ),
    ),
    "bamba": (
        "bamba",
        dict(_COMMON, **_MAMBA, num_hidden_layers=4, head_dim=16, mamba_n_groups=1, attn_layer_indices=[1]),
    ),
    # gpt-oss-tiny's shapes; init 0.2 and swiglu_limit 1.5 so that both clamps of the SwiGLU act.
    "gpt_oss": (
        "gpt_oss",
        dict(
            _COMMON,
            head_dim=64,
            intermediate_size=48,
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            initializer_range=0.2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
}
# gpt-oss with its real window (128) on the tiny shapes above.
CASES["gpt_oss_w128"] = ("gpt_oss", dict(CASES["gpt_oss"][1], sliding_window=128))


def build_hf_model(case: str, seed: int = 0) -> Any:
  """A tiny float32 transformers causal LM of `case`, with seeded noise on its 1-D parameters."""
  # pylint: disable=import-outside-toplevel  # torch/transformers are optional test dependencies (hf marker)
  import torch
  import transformers

  model_type, kwargs = CASES[case]
  config = transformers.AutoConfig.for_model(model_type, **kwargs)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
  generator = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if param.ndim == 1 or name.endswith("_bias"):
        param.add_(0.1 * torch.randn(param.shape, generator=generator))
  return model.eval()
