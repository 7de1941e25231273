"""The persistent compilation cache: the engine's compiled step programs kept on disk for the next process.

A cold start compiles one program per step shape (a prefill bucket, a decode bucket, ...), seconds each on a CPU. JAX
can keep what it compiles in a folder, keyed by the lowered program, the compile options, the devices and the
jax/jaxlib versions, so a later process that runs the same model with the same shapes loads the executables instead
of compiling them; a changed model, shape, flag or JAX version is a new key, never a stale hit. The config key
`compilation_cache_dir` names the folder (`""` turns it off). Like JAX, it keeps only programs that took at least
`jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile: the model steps, not the single ops of
eager code.

JAX sets its cache up once per process, so a folder JAX already has (the `JAX_COMPILATION_CACHE_DIR` environment
variable, or `jax.config` set by the caller) is kept, and `JAX_ENABLE_COMPILATION_CACHE=false` turns caching off
whatever the config says. The folder is trusted: whoever can write to it can make this process run their code, so
it must not be shared with untrusted users.
"""

from __future__ import annotations

import os

import jax

from maxtext.configs.errors import ConfigError

# JAX's flags are attributes of jax.config made at run time, which pylint cannot see.
# pylint: disable=no-member

# The folder's size limit when JAX's is unset (-1, unlimited): least recently used programs are evicted beyond it.
DEFAULT_MAX_BYTES = 1 << 30


def configure(path: str) -> str | None:
  """Points JAX's persistent compilation cache at `path` (the config key `compilation_cache_dir`), creating it.

  Args:
    path: the folder; `~` is expanded. `""` sets nothing.

  Returns:
    The folder JAX caches compiled programs in from now on, or None when caching is off (`path` is `""` and JAX
    has no folder, or `JAX_ENABLE_COMPILATION_CACHE` is false). A folder JAX already had is returned unchanged.

  Raises:
    ConfigError: `path` is not a string, or names something that is not a folder, or a folder that cannot be
      created.
  """
  if not isinstance(path, str):
    raise ConfigError(f"compilation_cache_dir={path!r}: must be a folder path (a string; '' turns the cache off)")
  if not jax.config.jax_enable_compilation_cache:
    return None
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if not path:
    return None
  folder = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise ConfigError(f"compilation_cache_dir={path!r}: must be a folder; {folder} is a file")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"compilation_cache_dir={path!r}: cannot create the folder {folder}: {e.strerror or e}") from e
  if not os.access(folder, os.W_OK | os.X_OK):
    raise ConfigError(f"compilation_cache_dir={path!r}: the folder {folder} is not writable")
  if jax.config.jax_compilation_cache_max_size == -1:
    jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
  jax.config.update("jax_compilation_cache_dir", folder)
  return folder
