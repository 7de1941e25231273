"""What the upstream tier runs: every family as a tiny Hugging Face folder, and the engine settings of each run.

Shared by the tier's tests (vLLM venv) and `references.py` (main venv) as plain data. Three prompts of 5, 17 and
40 tokens decode together; with blocks of 16 tokens and a 32-token step budget the 40-token prompt spans three
blocks and is prefilled in two chunks.
"""

from __future__ import annotations

PROMPTS = (
    (11, 7, 300, 42, 5),
    tuple(range(20, 37)),
    tuple((7 * i + 3) % 500 for i in range(40)),
)
MAX_TOKENS = 12
ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": False,
    "num_gpu_blocks_override": 96,
    "seed": 0,
}
MAXTEXT_CONFIG = {"kernel_backend": "reference"}

# case -> (tests/hf_cases.py family, whether the runner needs docs/tpu-inference-kv-cache-spec.patch)
FAMILIES = {
    "llama": ("llama", False),
    "qwen3": ("qwen3_untied", False),
    "gemma3": ("gemma3", True),
    "qwen3_next_dense": ("qwen3_next_dense", True),
    "qwen3_next_moe": ("qwen3_next_moe", True),
    "qwen3_5": ("qwen3_5", True),
    "qwen3_5_moe": ("qwen3_5_moe", True),
    "granite4": ("granite_moe", True),
    "bamba": ("bamba", True),
    "gpt_oss": ("gpt_oss", True),
}


# Gemma3 whose last two layers (4: sliding, 5: full) read the K/V of layers 3 and 2; transformers has no such model.
KV_SHARING = {
    "family": "gemma3",
    "maxtext_config": {"num_kv_shared_layers": 2},
    "kv_shared_layers": [4, 5],
}


# Prefix caching on a hybrid family: a first request, then two that share its first 48 tokens (three blocks).
PREFIX = tuple((11 * i + 5) % 500 for i in range(48))
PREFIX_ROUNDS = ((PREFIX + (5, 6, 7),), (PREFIX + (9, 10), PREFIX + (11,)))
PREFIX_FAMILY = "qwen3_next_moe"


# Real windows: prompts longer than the window (1,100 tokens for Gemma3's 1024, 160 for gpt-oss's 128), prefilled
# in chunks of 512 (Gemma3) or 64 tokens.
LONG = {
    "gemma3_5to1": {
        "family": "gemma3_5to1",
        "prompts": [[(13 * i + 1) % 500 for i in range(1100)], [3, 4, 5]],
        "engine": {"max_model_len": 1152, "max_num_batched_tokens": 512, "num_gpu_blocks_override": 448},
    },
    "gpt_oss_w128": {
        "family": "gpt_oss_w128",
        "prompts": [[(13 * i + 1) % 500 for i in range(160)], [3, 4, 5]],
        "engine": {"max_model_len": 192, "max_num_batched_tokens": 64, "num_gpu_blocks_override": 64},
    },
}


def reference_cases() -> dict[str, dict]:
  """`references.py`'s input: the family, prompts and length of every case."""
  common = {"prompts": [list(p) for p in PROMPTS], "max_tokens": MAX_TOKENS}
  out = {name: {"family": family, **common} for name, (family, _) in FAMILIES.items()}
  out["gemma3_kv_sharing"] = {**KV_SHARING, **common}
  prefix_prompts = [list(p) for prompts in PREFIX_ROUNDS for p in prompts]
  out["prefix_caching"] = {"family": FAMILIES[PREFIX_FAMILY][0], "prompts": prefix_prompts, "max_tokens": MAX_TOKENS}
  for name, case in LONG.items():
    # The same cache as vLLM's run: one pool of num_gpu_blocks_override blocks shared by every group.
    sizes = {
        "max_target_length": case["engine"]["max_model_len"],
        "num_kv_blocks": case["engine"]["num_gpu_blocks_override"],
    }
    out[name] = {"family": case["family"], "prompts": case["prompts"], "max_tokens": MAX_TOKENS, "maxtext_config": sizes}
  return out


# `vllm serve` against the openai client (serve_test.py): a tiny Llama with a trained tokenizer and a chat template
# (serve_model.py builds it), greedy requests compared with this package's offline engine over the same folder.
SERVE_FAMILY = "llama"
SERVE_MAX_TOKENS = 12
SERVE_MAX_MODEL_LEN = 128  # the server's --max-model-len (docs/serving.md's command) and the offline engine's
SERVE_COMPLETIONS = (
    "The quick brown fox",
    "A server answers",
    "Tokens are counted one by one",
    "Seven small models",
    "Every prompt gets an answer",
    "The cache keeps blocks",
    "Greedy decoding is deterministic",
    "Two cores share the work",
)
SERVE_CHATS = (
    ({"role": "user", "content": "What does the server do?"},),
    (
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a color."},
    ),
)
