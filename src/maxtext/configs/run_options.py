"""Which configuration keys describe the model and which only steer one run of `maxtext-decode`.

One YAML and one `key=value` surface set both, as in MaxText, and one loaded config holds both. The model is built
from the model's config alone (`model_config`): the vLLM adapter builds it that way, whether a vLLM runner or this
package's reference runner constructs it, so a key that only the CLI or the reference runner reads never reaches the
model. The run options are

  - the CLI's: the prompts, chat templating, the sampling defaults and the output (`CLI_KEYS`), which under vLLM are
    the request's `SamplingParams` and the caller's business;
  - the reference runner's CPU and compilation knobs (`RUNNER_KEYS`), which a vLLM runner has its own settings for.

The category of every key is declared in `keys.py` (`CLI`, `RUNNER`; the model's config is `MODEL` and
`RUNTIME`). Everything else (the model's shape and source, dtypes, the kernel backend, the cache, layout, scheduler
and mesh keys the runner sizes its caches and batches from) is the model's config.
"""

from __future__ import annotations

from collections.abc import Iterable

import ml_collections

from maxtext.configs import keys as config_keys
from maxtext.configs.errors import ConfigError

# The categories are declared beside each key (`keys.py`).
CLI_KEYS = tuple(sorted(config_keys.names(config_keys.CLI)))
RUNNER_KEYS = tuple(sorted(config_keys.names(config_keys.RUNNER)))
RUN_OPTION_KEYS = config_keys.RUN_OPTION_KEYS


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
