"""Which configuration keys describe the model and which only steer one run of `maxtext-decode`.

One YAML and one `key=value` surface set both, as in MaxText, and one loaded config holds both. The model is built
from the model's config alone (`model_config`): the vLLM adapter builds it that way, whether a vLLM runner or this
package's reference runner constructs it, so a key that only the CLI or the reference runner reads never reaches the
model. The run options are

  - the CLI's: the prompts, chat templating, the sampling defaults and the output (`CLI_KEYS`), which under vLLM are
    the request's `SamplingParams` and the caller's business;
  - the reference runner's CPU and compilation knobs (`RUNNER_KEYS`), which a vLLM runner has its own settings for.

Everything else (the model's shape and source, dtypes, the kernel backend, the cache, layout, scheduler and mesh
keys the runner sizes its caches and batches from) is the model's config. Of those, the keys that never change a
parameter array (`WEIGHT_NEUTRAL_KEYS`: the checkpoint paths, the caches', scheduler's and tokenizer's settings) are
left out of the prepared weights' key (`checkpoint/weight_cache.py`); the step programs' key
(`inference/step_programs.py`) leaves out the run options. `key_category` names a key's category.
"""

from __future__ import annotations

from collections.abc import Iterable

import ml_collections

from maxtext.configs.errors import ConfigError

CLI_KEYS = (
    "prompt",
    "prompt_token_ids",
    "prompts_file",
    "use_chat_template",
    "max_new_tokens",
    "decode_sampling_temperature",
    "decode_sampling_top_k",
    "decode_sampling_nucleus_p",
    "seed",
    "logprobs",
    "output_format",
    "dry_run",
)
RUNNER_KEYS = (
    "compilation_cache_dir",
    "background_compile",
    "overlap_decode_steps",
    "huge_page_weights",
    "cpu_weight_panels",
    "weight_cache",
    "weight_cache_max_bytes",
)
RUN_OPTION_KEYS = CLI_KEYS + RUNNER_KEYS
# Model keys that never change a parameter array: the checkpoint paths (the weight cache keys their content
# instead), the caches', scheduler's and tokenizer's settings.
WEIGHT_NEUTRAL_KEYS = frozenset(
    {
        "load_parameters_path",
        "hf_model_path",
        "gguf_model_path",
        "tokenizer_path",
        "kv_cache_dtype",
        "kv_cache_layout",
        "hybrid_kv_cache",
        "block_size",
        "kv_cache_memory_bytes",
        "num_kv_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "min_token_bucket",
        "max_target_length",
        "enable_prefix_caching",
        "mamba_block_size",
    }
)
CLI, RUNNER, SERVING, PARAMETERS = "cli", "runner", "serving", "parameters"


def key_category(key: str) -> str:
  """The category of a config key: `cli` and `runner` (run options, never the model's), `serving` (the model's,
  but no parameter depends on it: `WEIGHT_NEUTRAL_KEYS`) or `parameters` (shapes the parameters)."""
  if key in CLI_KEYS:
    return CLI
  if key in RUNNER_KEYS:
    return RUNNER
  return SERVING if key in WEIGHT_NEUTRAL_KEYS else PARAMETERS


def model_config(cfg: ml_collections.FrozenConfigDict) -> ml_collections.FrozenConfigDict:
  """The model's part of a loaded config: every key except the run options.

  Args:
    cfg: a config built by `load_config` / `load_run_config` (with or without its run options).

  Raises:
    TypeError: `cfg` is not a built config.
  """
  if not isinstance(cfg, ml_collections.FrozenConfigDict):
    raise TypeError(f"model_config takes a config built by load_config, got {type(cfg).__name__}")
  values = cfg.as_configdict().to_dict()
  return ml_collections.FrozenConfigDict({k: v for k, v in values.items() if k not in RUN_OPTION_KEYS})


def reject_run_options(keys: Iterable[str], where: str) -> None:
  """Raises when `keys` name a run option, which the model's config cannot carry.

  Args:
    keys: the keys given.
    where: where they were given, for the message (e.g. "additional_config['maxtext_config']").

  Raises:
    ConfigError: naming the run options among `keys`.
  """
  given = [k for k in keys if k in RUN_OPTION_KEYS]
  if given:
    raise ConfigError(
        f"{where} sets {', '.join(sorted(given))}: options of a maxtext-decode run, not of the model; under vLLM"
        " the request's SamplingParams and the runner's own settings take their place"
    )
