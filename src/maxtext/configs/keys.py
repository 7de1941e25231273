"""One declaration per configuration key: its type, category and a one-line description.

`base.yml` holds the defaults users see; this module says what each key is. `keys_test` checks that the two list
the same keys with the same types. The category says who reads a key and what it may change:

  - `MODEL`: the model's shape, family, numerics and mesh; a change may change the parameters' arrays, so these
    keys are part of the weight cache's key and of the compiled step programs' key;
  - `RUNTIME`: the model's config keys that never change a parameter array (the checkpoint paths, whose content is
    hashed instead, and the caches', scheduler's and tokenizer's settings): in the step programs' key, not in the
    weight cache's;
  - `CLI`: options of a `maxtext-decode` run (prompts, sampling, output) that vLLM takes from the request instead;
  - `RUNNER`: the reference runner's own CPU and compilation knobs, which a vLLM runner has its own settings for.

`CLI` and `RUNNER` keys are the run options (`run_options`): the model's config does not carry them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from maxtext.configs.errors import ConfigError

MODEL = "model"
RUNTIME = "runtime"
CLI = "cli"
RUNNER = "runner"
CATEGORIES = (MODEL, RUNTIME, CLI, RUNNER)
# Bounds of numeric keys.
POSITIVE = "> 0"
NON_NEGATIVE = ">= 0"
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Key:
  """A configuration key: `type` is its default's type in base.yml, `element` the element type of a list, `bound`
  a numeric key's `POSITIVE` or `NON_NEGATIVE`, `choices` a string key's allowed values."""

  name: str
  type: type
  category: str
  description: str
  element: type | None = None
  bound: str | None = None
  choices: tuple[str, ...] | None = None


def _key(
    name: str,
    type_: type,
    category: str,
    description: str,
    *,
    element: type | None = None,
    bound: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> Key:
  return Key(name, type_, category, description, element, bound, choices)


_DECLARED = (
    _key("model_name", str, MODEL, 'name of configs/models/<model_name>.yml to load ("default" loads none)'),
    _key("load_parameters_path", str, RUNTIME, 'Orbax checkpoint directory with the parameters ("" = none)'),
    _key("hf_model_path", str, RUNTIME, 'local Hugging Face folder (config.json + safetensors) ("" = none)'),
    _key("gguf_model_path", str, RUNTIME, 'local GGUF file (llama.cpp format: config, weights, tokenizer) ("" = none)'),
    _key(
        "tokenizer_path",
        str,
        RUNTIME,
        'tokenizer folder or tokenizer.json ("" = hf_model_path / gguf_model_path, else byte-level)',
    ),
    _key(
        "decoder_block",
        str,
        MODEL,
        "family: llama2 | qwen3 | gemma3 | qwen3_next | qwen3_5 | granite_hybrid | bamba | gpt_oss",
    ),
    _key("base_emb_dim", int, MODEL, "hidden size D", bound=POSITIVE),
    _key("base_num_decoder_layers", int, MODEL, "number of decoder layers L", bound=POSITIVE),
    _key("base_num_query_heads", int, MODEL, "query heads Hq", bound=POSITIVE),
    _key("base_num_kv_heads", int, MODEL, "key/value heads Hkv (Hq must be a multiple)", bound=POSITIVE),
    _key("head_dim", int, MODEL, "per-head dimension of attention layers", bound=POSITIVE),
    _key("base_mlp_dim", int, MODEL, "intermediate size of dense MLPs", bound=POSITIVE),
    _key("vocab_size", int, MODEL, "vocabulary size V", bound=POSITIVE),
    _key("mlp_activations", list, MODEL, 'gated MLP: [gate activation (silu | gelu_tanh), "linear"]', element=str),
    _key("normalization_layer_epsilon", float, MODEL, "RMSNorm epsilon"),
    _key("logits_via_embedding", bool, MODEL, "tie the output head to the token embedding"),
    _key("attention_bias", bool, MODEL, "q/k/v/o projections carry a bias"),
    _key("mlp_bias", bool, MODEL, "gate/up/down projections carry a bias"),
    _key(
        "query_pre_attn_scalar",
        float,
        MODEL,
        "attention scale is query_pre_attn_scalar**-0.5 (0 = head_dim)",
        bound=NON_NEGATIVE,
    ),
    _key("attn_logits_soft_cap", float, MODEL, "tanh soft cap on attention logits (0 = none)", bound=NON_NEGATIVE),
    _key("final_logits_soft_cap", float, MODEL, "tanh soft cap on output logits (0 = none)", bound=NON_NEGATIVE),
    _key(
        "layer_types",
        list,
        MODEL,
        "per-layer kinds (full_attention | sliding_attention | linear_attention | mamba); [] = derive",
        element=str,
    ),
    _key(
        "sliding_window_size",
        int,
        MODEL,
        "window W of sliding_attention layers, self included (0 = no sliding layers)",
        bound=NON_NEGATIVE,
    ),
    _key(
        "inhomogeneous_layer_cycle_interval",
        int,
        MODEL,
        "every N-th layer is full attention (the others slide, are GDN or mamba by family)",
        bound=POSITIVE,
    ),
    _key(
        "num_kv_shared_layers",
        int,
        MODEL,
        "the last N layers reuse the K/V of the last earlier non-shared layer of their type",
        bound=NON_NEGATIVE,
    ),
    _key("rope_max_timescale", float, MODEL, "rope theta of full-attention (global) layers"),
    _key("local_rope_max_timescale", float, MODEL, "rope theta of sliding-attention (local) layers"),
    _key("partial_rotary_factor", float, MODEL, "fraction of head_dim that is rotated (qwen3_next: 0.25)"),
    _key(
        "rope_type",
        str,
        MODEL,
        "default | linear | llama3 | yarn (scaling of global layers; gpt_oss: all layers)",
        choices=("default", "linear", "llama3", "yarn"),
    ),
    _key("rope_scaling_factor", float, MODEL, "linear / llama3 / yarn scaling factor"),
    _key("rope_low_freq_factor", float, MODEL, "llama3 rope scaling: low-frequency factor"),
    _key("rope_high_freq_factor", float, MODEL, "llama3 rope scaling: high-frequency factor"),
    _key(
        "rope_original_max_position_embeddings",
        int,
        MODEL,
        "llama3 / yarn rope scaling: original context length",
        bound=POSITIVE,
    ),
    _key("rope_beta_fast", float, MODEL, "yarn: rotations bounding the dims kept unscaled (high frequencies)"),
    _key("rope_beta_slow", float, MODEL, "yarn: rotations bounding the dims fully divided by the factor"),
    _key("rope_truncate", bool, MODEL, "yarn: round the ramp bounds to whole dims"),
    _key("rope_attention_factor", float, MODEL, "yarn: multiplier of cos/sin (0 = 0.1 * ln(factor) + 1)"),
    _key("gdn_num_key_heads", int, MODEL, "key heads nk", bound=POSITIVE),
    _key("gdn_num_value_heads", int, MODEL, "value heads nv (a multiple of nk)", bound=POSITIVE),
    _key("gdn_key_head_dim", int, MODEL, "key head dim hk", bound=POSITIVE),
    _key("gdn_value_head_dim", int, MODEL, "value head dim hv", bound=POSITIVE),
    _key("gdn_conv_kernel_dim", int, MODEL, "depthwise causal conv kernel size K", bound=POSITIVE),
    _key("gdn_chunk_size", int, MODEL, "chunk length of the chunked full-sequence form", bound=POSITIVE),
    _key("mamba_num_heads", int, MODEL, "SSM heads nh (the inner size is nh * mamba_head_dim)", bound=POSITIVE),
    _key("mamba_head_dim", int, MODEL, "channels per SSM head hd", bound=POSITIVE),
    _key("mamba_state_dim", int, MODEL, "SSM state size N per head", bound=POSITIVE),
    _key(
        "mamba_num_groups",
        int,
        MODEL,
        "groups G of B/C (nh a multiple); head h reads group h // (nh / G)",
        bound=POSITIVE,
    ),
    _key("mamba_conv_kernel_dim", int, MODEL, "depthwise causal conv kernel size K", bound=POSITIVE),
    _key("mamba_conv_bias", bool, MODEL, "the depthwise conv has a bias"),
    _key("mamba_proj_bias", bool, MODEL, "the input and output projections have biases"),
    _key("mamba_chunk_size", int, MODEL, "chunk length of the chunked full-sequence form", bound=POSITIVE),
    _key(
        "mamba_time_step_min", float, MODEL, "dt = softplus(dt + dt_bias) is clamped to at least this", bound=NON_NEGATIVE
    ),
    _key("mamba_time_step_max", float, MODEL, "... and to at most this (0 = no upper limit)", bound=NON_NEGATIVE),
    _key("embedding_multiplier", float, MODEL, "token embeddings are multiplied by this", bound=POSITIVE),
    _key(
        "residual_multiplier",
        float,
        MODEL,
        "mixer and MLP outputs are multiplied by this before the residual add",
        bound=POSITIVE,
    ),
    _key(
        "attention_multiplier",
        float,
        MODEL,
        "attention logit scale (0 = query_pre_attn_scalar**-0.5 / head_dim**-0.5)",
        bound=NON_NEGATIVE,
    ),
    _key("logits_scaling", float, MODEL, "output logits are divided by this", bound=POSITIVE),
    _key("use_rope", bool, MODEL, "false: attention layers have no positional embedding (NoPE)"),
    _key("shared_expert_gate", bool, MODEL, "the shared expert is gated by sigmoid(shared_gate(x)) (false: plain sum)"),
    _key("num_experts", int, MODEL, "routed experts E (0 = dense MLP everywhere)", bound=NON_NEGATIVE),
    _key("num_experts_per_tok", int, MODEL, "top-k experts per token", bound=POSITIVE),
    _key("base_moe_mlp_dim", int, MODEL, "intermediate size of each routed expert", bound=NON_NEGATIVE),
    _key(
        "shared_expert_mlp_dim",
        int,
        MODEL,
        "intermediate size of the sigmoid-gated shared expert (0 = none)",
        bound=NON_NEGATIVE,
    ),
    _key("norm_topk_prob", bool, MODEL, "renormalise the top-k router probabilities"),
    _key(
        "decoder_sparse_step",
        int,
        MODEL,
        "layer i is MoE iff (i + 1) % decoder_sparse_step == 0 (and not mlp_only)",
        bound=POSITIVE,
    ),
    _key("mlp_only_layers", list, MODEL, "layers that use the dense MLP even in a MoE model", element=int),
    _key("swiglu_alpha", float, MODEL, "gpt_oss experts: gate * sigmoid(alpha * gate)"),
    _key("swiglu_limit", float, MODEL, "gpt_oss experts: gate clamped to <= limit, up to [-limit, limit]"),
    _key("dtype", str, MODEL, "compute dtype: float32 | bfloat16", choices=DTYPES),
    _key("weight_dtype", str, MODEL, "parameter dtype: float32 | bfloat16", choices=DTYPES),
    _key(
        "quantization",
        str,
        MODEL,
        'weight-only quantization: "" (weights in weight_dtype) | int8w (kernel_backend=cpu)',
    ),
    _key(
        "greedy_head_candidates",
        int,
        MODEL,
        "kernel_backend=cpu, tied head: candidates a greedy pick ranks with an int4 table (0 = off)",
        bound=NON_NEGATIVE,
    ),
    _key(
        "kv_cache_dtype",
        str,
        RUNTIME,
        "attention cache dtype (auto = dtype): auto | float32 | bfloat16",
        choices=("auto",) + DTYPES,
    ),
    _key("init_seed", int, MODEL, "seed of the random initialisation (load_format dummy)", bound=NON_NEGATIVE),
    _key(
        "kv_cache_layout",
        str,
        RUNTIME,
        "physical array order: layer | hybrid (tpu-inference's) | shuffled",
        choices=("layer", "hybrid", "shuffled"),
    ),
    _key(
        "hybrid_kv_cache",
        bool,
        RUNTIME,
        "vLLM's equal-size groups per layer kind, sharing arrays; false: one attention group",
    ),
    _key("block_size", int, RUNTIME, "tokens per attention cache block", bound=POSITIVE),
    _key(
        "kv_cache_memory_bytes",
        int,
        RUNTIME,
        "bytes of the KV cache (attention blocks + recurrent state slots) (0: not set)",
        bound=NON_NEGATIVE,
    ),
    _key(
        "num_kv_blocks",
        int,
        RUNTIME,
        "blocks of the one attention pool; overrides kv_cache_memory_bytes (0: from it, or 256 a group)",
        bound=NON_NEGATIVE,
    ),
    _key("max_num_seqs", int, RUNTIME, "requests per step", bound=POSITIVE),
    _key("max_num_batched_tokens", int, RUNTIME, "token budget per step (chunked prefill beyond it)", bound=POSITIVE),
    _key(
        "admission_reserve",
        str,
        RUNTIME,
        "admit a waiting request when the free blocks cover: none = its blocks for this step (vLLM) | max_tokens ="
        " also every running request's and its own growth up to max_tokens",
        choices=("none", "max_tokens"),
    ),
    _key("min_token_bucket", int, RUNTIME, "smallest padded token count of a step (a power of two)", bound=POSITIVE),
    _key("max_target_length", int, RUNTIME, "longest prompt + generation per request", bound=POSITIVE),
    _key(
        "enable_prefix_caching",
        bool,
        RUNTIME,
        "automatic prefix caching: reuse the cached blocks (and states) of equal prefixes",
    ),
    _key(
        "mamba_block_size",
        int,
        RUNTIME,
        "prefix caching: tokens per recurrent state block, a multiple of block_size (0 = block_size)",
    ),
    _key("ici_data_parallelism", int, MODEL, "the mesh's data axis (requests / cache blocks)", bound=POSITIVE),
    _key(
        "ici_tensor_parallelism",
        int,
        MODEL,
        "the mesh's model axis (attention heads, KV heads, GDN heads, MLP)",
        bound=POSITIVE,
    ),
    _key("ici_expert_parallelism", int, MODEL, "the mesh's expert axis (MoE experts)", bound=POSITIVE),
    _key(
        "logical_axis_rules",
        list,
        MODEL,
        "[logical axis, mesh axis | [mesh axes] | null]; unlisted axes replicate",
        element=list,
    ),
    _key(
        "kernel_backend",
        str,
        MODEL,
        'runner ops and dense products: reference | cpu | tpu_inference ("" = the device\'s default)',
    ),
    _key("compilation_cache_dir", str, RUNNER, 'compiled step programs kept for the next run ("" = off)'),
    _key(
        "background_compile",
        bool,
        RUNNER,
        "compile the one-request greedy decode step in a thread while the weights load",
    ),
    _key(
        "overlap_decode_steps",
        bool,
        RUNNER,
        "dispatch the next greedy decode step before this one's tokens reach the host",
    ),
    _key(
        "huge_page_weights",
        bool,
        RUNNER,
        "kernel_backend=cpu: move the weights onto 2 MiB pages after the first step (Linux 6.1+)",
    ),
    _key(
        "cpu_weight_panels",
        bool,
        RUNNER,
        "kernel_backend=cpu: fp32 dense kernels stored in 32-column panels (faster decode reads)",
    ),
    _key(
        "memory_check",
        bool,
        RUNNER,
        "refuse a CPU run whose parameters, caches and activations exceed the memory available",
    ),
    _key("weight_cache", bool, RUNNER, "keep a checkpoint's prepared weights on disk; a later start reads them"),
    _key(
        "weight_cache_max_bytes",
        int,
        RUNNER,
        "size limit of the weight cache folder (least recently used entries go first)",
    ),
    _key("prompt", str, CLI, 'prompt text ("" with prompt_token_ids set)'),
    _key("prompt_token_ids", list, CLI, "prompt as token ids (overrides prompt when non-empty)", element=int),
    _key("prompts_file", str, CLI, 'several prompts, decoded together: one per line, or JSON Lines ("" = none)'),
    _key("use_chat_template", bool, CLI, "wrap text prompts in the model's chat template (as a user message)"),
    _key("max_new_tokens", int, CLI, "tokens to generate per request (0 = until eos, within max_target_length)"),
    _key("decode_sampling_temperature", float, CLI, "0 = greedy; at most 2", bound=NON_NEGATIVE),
    _key("decode_sampling_top_k", int, CLI, "<= 0 = no top-k"),
    _key("decode_sampling_nucleus_p", float, CLI, "top-p in (0, 1]; 1 (or <= 0) = no top-p"),
    _key("seed", int, CLI, "sampling seed, and the permutation seed of kv_cache_layout=shuffled", bound=NON_NEGATIVE),
    _key("logprobs", int, CLI, "number of top logprobs to return per token (0 = none)", bound=NON_NEGATIVE),
    _key("output_format", str, CLI, "text | json", choices=("text", "json")),
    _key("dry_run", bool, CLI, "print the cache layout and exit without running the model"),
)

KEYS = MappingProxyType({k.name: k for k in _DECLARED})


def names(*categories: str) -> frozenset[str]:
  """The keys of the given categories."""
  return frozenset(k.name for k in _DECLARED if k.category in categories)


RUN_OPTION_KEYS = names(CLI, RUNNER)
# Keys of the model's config that never change a parameter array: left out of the weight cache's key.
RUNTIME_KEYS = names(RUNTIME)
LIST_ELEMENT_TYPES = MappingProxyType({k.name: k.element for k in _DECLARED if k.element is not None})


def check_choices(values: Mapping[str, Any]) -> None:
  """Raises when a key with declared choices has another value.

  Raises:
    ConfigError: `key=value: must be one of ...`.
  """
  for key in _DECLARED:
    if key.choices is not None and values[key.name] not in key.choices:
      raise ConfigError(f"{key.name}={values[key.name]!r}: must be one of {', '.join(key.choices)}")


def check_bounds(values: Mapping[str, Any], bound: str) -> None:
  """Raises when a key declared with `bound` (`POSITIVE` or `NON_NEGATIVE`) is outside it.

  Raises:
    ConfigError: `key=value: must be > 0` (or `>= 0`).
  """
  for key in _DECLARED:
    if key.bound == bound and not (values[key.name] > 0 if bound == POSITIVE else values[key.name] >= 0):
      raise ConfigError(f"{key.name}={values[key.name]!r}: must be {bound}")
