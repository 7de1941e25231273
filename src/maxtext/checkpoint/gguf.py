"""Load a GGUF file (llama.cpp's format) into this package's config, parameters and tokenizer.

Architectures (declared by the families, `Family.gguf`): `llama` (decoder_block llama2), `qwen3`, `gemma3`. The container
(header, metadata, tensor index, block types) is read by `gguf_format`, which maps the file and dequantizes a tensor
into the weight dtype only when it is read, a chunk at a time (see `SUPPORTED_TENSOR_TYPES`). GGUF's conventions are
undone on the way in, so the Hugging Face layout code (`hf_layout`) builds the canonical parameters exactly as for
a safetensors folder:
  - tensor names (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...) map to the Hugging Face names (the shared
    table, with the architecture's own names: `GGUFMapping.layer_names`; Gemma 3's `ffn_norm` is the norm before
    the MLP, `post_attention_norm` and `post_ffw_norm` the sandwich norms);
  - dimensions are stored innermost first (a Linear [out, in] is listed as [in, out]); the reader's arrays are in
    row-major order, so a dequantized tensor already has the Hugging Face shape;
  - for `llama` (`GGUFMapping.permuted_rope_rows`), llama.cpp's converter permutes the rows of attn_q / attn_k (per
    head, the two rotary halves are interleaved for its GPT-J style rope); the inverse permutation restores the
    Hugging Face (rotate-half) rows.
    Qwen3 and Gemma 3 files use NeoX rope and are stored unpermuted;
  - for `gemma3` (`GGUFMapping.norm_shift`), llama.cpp's converter added 1 to every norm weight (Gemma computes
    x * (1 + w)); it is subtracted again in float32, before the cast to the weight dtype.
The metadata becomes a Hugging Face style config dict for `hf_config.hf_config_to_overrides` (with the fields
the file leaves to llama.cpp's code, `GGUFMapping.config`: Gemma 3's layer pattern, sliding RoPE base and query
scale), the vocabulary a `tokenizers.Tokenizer` (byte-level BPE from the merges, the `gpt2` tokenizer model; or
SentencePiece BPE with byte fallback, the `llama` model of Gemma files, whose merges follow the vocabulary order),
and `tokenizer.chat_template` the chat template.

    cfg = load_gguf_config("model.gguf")
    for name, array in iter_gguf_params("model.gguf", cfg): ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from maxtext import user_cache
from maxtext.checkpoint import gguf_format, hf_config, hf_layout
from maxtext.configs import families, load_config

# GGUF general.architecture -> Hugging Face model_type (whose config mapping and tensor layout are reused); each
# family declares the architectures holding it (`Family.gguf`).
ARCHITECTURES: dict[str, str] = {a: families.gguf_mapping(a).model_type for a in families.gguf_architectures()}
# ggml tensor types this loader reads (dequantized through float32 chunks by `gguf_format.dequantize`).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = gguf_format.DEQUANTIZED_TYPES
# llama.cpp's tokenizer.ggml.pre names -> the pre-tokenizer of the vocabulary (see `_pre_tokenizer`).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, str | None] = {
    "default": None,  # GPT-2's own regex (ByteLevel's)
    "gpt2": None,
    "smollm": "digits",  # GPT-2's regex after splitting every digit off, as SmolLM's tokenizer.json does
    "qwen2": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values (llama.cpp's token attributes)
_SPACE = "\u2581"  # SentencePiece's visible space

# GGUF tensor names (after `blk.{i}.`) -> Hugging Face names (after `model.layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_MAX_LISTED = 5


class GGUFError(ValueError):
  """A GGUF file cannot be read or does not describe a model this package supports."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor of a GGUF file: its Hugging Face name, its shape in Hugging Face (row-major) order and its type."""

  gguf_name: str
  name: str
  shape: tuple[int, ...]
  type_name: str


class GGUFFile:
  """A GGUF file (memory-mapped by `gguf_format.GGUFContainer`): metadata, tensor index, dequantized reads.

  Tensors of a type ggml defines but this loader does not read are listed in `unsupported`: opening does not refuse
  them (the metadata, a tokenizer, stay readable), `check_loadable` names them all with an unsupported architecture,
  and `read` refuses them.

  Args:
    path: the .gguf file.

  Raises:
    FileNotFoundError: no such file.
    GGUFError: a folder, not a GGUF file, truncated or corrupt, or a tensor of a type ggml does not define.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(self.path):
      found = sorted(name for name in os.listdir(self.path) if name.endswith(".gguf"))
      hint = f"; it holds {', '.join(found[:3])}" if found else "; it holds no .gguf file"
      if os.path.isfile(os.path.join(self.path, "config.json")):
        hint += " but a config.json: a Hugging Face folder is given as hf_model_path"
      raise GGUFError(
          f"gguf_model_path={self.path!r} is a folder, not a GGUF file; give the path of the .gguf file itself{hint}"
      )
    if not os.path.isfile(self.path):
      raise FileNotFoundError(
          f"GGUF file {self.path!r} (gguf_model_path) does not exist; for the README's example model run"
          " `python scripts/fetch_example_model.py` first"
      )
    try:
      self._container = gguf_format.GGUFContainer(self.path)
    except gguf_format.GGUFFormatError as e:
      raise GGUFError(
          f"{self.path}: not a readable GGUF file ({os.path.getsize(self.path)} bytes; truncated or corrupt?"
          f" download it again): {e}"
      ) from None
    self.tensors: dict[str, GGUFTensor] = {}
    self.unsupported: list[GGUFTensor] = []  # tensors of a type this loader does not read, in file order
    self._raw: dict[str, gguf_format.TensorInfo] = {}
    arch = self._container.fields.get("general.architecture")
    for tensor in self._container.tensors:
      if not tensor.type_name:
        raise GGUFError(
            f"{self.path}: a tensor has an unknown tensor type (tensor {tensor.name!r}, type id {tensor.type_id});"
            f" this loader reads {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
      name = hf_tensor_name(tensor.name, arch if isinstance(arch, str) else None)
      self.tensors[name] = GGUFTensor(tensor.name, name, tensor.shape, tensor.type_name)
      self._raw[name] = tensor
      if tensor.type_name not in SUPPORTED_TENSOR_TYPES:  # its byte size is unknown here: no extent check
        self.unsupported.append(self.tensors[name])
        continue
      try:
        self._container.check_extent(tensor)
      except gguf_format.GGUFFormatError as e:
        raise GGUFError(
            f"{self.path}: not a readable GGUF file ({self._container.size} bytes; truncated or corrupt? download"
            f" it again): {e}"
        ) from None

  def field(self, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (str, number, bool or list), or `default` when absent."""
    return self._container.fields.get(key, default)

  @property
  def architecture(self) -> str:
    """general.architecture."""
    arch = self.field("general.architecture")
    if not isinstance(arch, str):
      raise GGUFError(f"{self.path}: metadata general.architecture is missing")
    return arch

  def read(self, name: str, dtype: Any = np.float32) -> np.ndarray:
    """The tensor of Hugging Face name `name`, dequantized to `dtype` (float32, or a narrower float such as bfloat16,
    never held whole in float32: `GGUFContainer.dequantize`) in Hugging Face shape.

    Raises:
      NotImplementedError: the tensor's type is not one this loader reads.
    """
    tensor = self.tensors[name]
    if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
      raise NotImplementedError(f"{self.path}: {_unsupported_types([tensor])}")
    return self._container.dequantize(self._raw[name], dtype)


def _unsupported_types(tensors: Sequence[GGUFTensor]) -> str:
  """`tensors` (at least one) grouped by type, then the supported types, as one clause."""
  by_type: dict[str, list[str]] = {}
  for tensor in tensors:
    by_type.setdefault(tensor.type_name, []).append(repr(tensor.gguf_name))
  clauses = [
      f"tensor {names[0]} has quantization type {type_name}"
      if len(names) == 1
      else f"{len(names)} tensors ({_listing(names)}) have quantization type {type_name}"
      for type_name, names in by_type.items()
  ]
  verb = "is" if len(by_type) == 1 else "are"
  return f"{', '.join(clauses)}, which {verb} not supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"


def check_loadable(file: GGUFFile) -> None:
  """Raises one error naming everything that keeps this loader from reading `file`'s model: an unsupported
  architecture and every tensor of an unsupported type (grouped by type), each with what is supported.

  Raises:
    GGUFError: general.architecture is missing.
    NotImplementedError: the architecture or a tensor type is not supported.
  """
  blockers = []
  arch = file.architecture
  if arch not in ARCHITECTURES:
    blockers.append(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
  if file.unsupported:
    blockers.append(_unsupported_types(file.unsupported))
  if blockers:
    raise NotImplementedError(f"{file.path}: {'; and '.join(blockers)}")


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
  del size, mtime_ns  # part of the cache key only: a file replaced on disk is read again
  return GGUFFile(path)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
  """`GGUFFile(path)`, cached: opening decodes every metadata array (the vocabulary and merges), and the config,
  the weights and the tokenizer all read the same file.

  Raises:
    FileNotFoundError, GGUFError: see `GGUFFile`.
  """
  full = os.path.abspath(os.path.expanduser(os.fspath(path)))
  if not os.path.isfile(full):
    return GGUFFile(full)  # raises FileNotFoundError, or GGUFError for a folder
  stat = os.stat(full)
  return _open_cached(full, stat.st_size, stat.st_mtime_ns)


def hf_tensor_name(gguf_name: str, architecture: str | None = None) -> str:
  """The Hugging Face name of a GGUF tensor name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)
  in a file of `architecture` (its `GGUFMapping.layer_names` win over the shared table); names without a
  counterpart are returned unchanged (and reported as unexpected by the loader)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  mapping = families.gguf_mapping(architecture) if architecture else None
  layer_names = _LAYER_NAMES | dict(mapping.layer_names) if mapping is not None else _LAYER_NAMES
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
    return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
  return gguf_name


def _uniform(value: Any, key: str, path: str) -> Any:
  """A per-layer metadata array must hold one value (this package's models have one head count for every layer)."""
  if isinstance(value, list):
    if not value or len(set(value)) != 1:
      raise NotImplementedError(f"{path}: metadata {key} differs between layers ({value}); only uniform values work")
    return value[0]
  return value


def gguf_to_hf_config(file: GGUFFile) -> dict[str, Any]:
  """A Hugging Face style config.json dict of the model a GGUF file holds.

  Raises:
    NotImplementedError: an unsupported architecture or tensor type (one error naming both, `check_loadable`), rope
      scaling, partial rotary embedding or rope frequency factors (`rope_freqs.weight`).
    GGUFError: a required metadata key is missing.
  """
  check_loadable(file)
  arch = file.architecture

  def require(key: str) -> Any:
    value = file.field(f"{arch}.{key}")
    if value is None:
      raise GGUFError(f"{file.path}: metadata {arch}.{key} is missing")
    return _uniform(value, f"{arch}.{key}", file.path)

  hidden = int(require("embedding_length"))
  heads = int(require("attention.head_count"))
  kv_heads = int(_uniform(file.field(f"{arch}.attention.head_count_kv", heads), "head_count_kv", file.path))
  head_dim = int(file.field(f"{arch}.attention.key_length", hidden // heads))
  value_dim = int(file.field(f"{arch}.attention.value_length", head_dim))
  rope_dim = int(file.field(f"{arch}.rope.dimension_count", head_dim))
  if value_dim != head_dim or rope_dim != head_dim:
    raise NotImplementedError(
        f"{file.path}: key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rope_dim}; this"
        " loader needs all three equal (full rotary embedding)"
    )
  if "rope_freqs.weight" in file.tensors:
    raise NotImplementedError(f"{file.path}: rope frequency factors (tensor rope_freqs.weight) are not supported")
  tokens = file.field("tokenizer.ggml.tokens")
  vocab = file.field(f"{arch}.vocab_size", len(tokens) if tokens else None)
  if vocab is None:
    raise GGUFError(f"{file.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is set")
  config: dict[str, Any] = {
      "model_type": ARCHITECTURES[arch],
      "hidden_size": hidden,
      "num_hidden_layers": int(require("block_count")),
      "intermediate_size": int(require("feed_forward_length")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "vocab_size": int(vocab),
      "rms_norm_eps": float(require("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(file.field(f"{arch}.rope.freq_base", 10000.0)),
      "max_position_embeddings": int(file.field(f"{arch}.context_length", 2048)),
      "tie_word_embeddings": "lm_head.weight" not in file.tensors,
      "attention_bias": "model.layers.0.self_attn.q_proj.bias" in file.tensors,
  }
  scaling = file.field(f"{arch}.rope.scaling.type", "none")
  if scaling == "linear":
    config["rope_scaling"] = {"rope_type": "linear", "factor": float(require("rope.scaling.factor"))}
  elif scaling != "none":
    raise NotImplementedError(f"{file.path}: {arch}.rope.scaling.type={scaling!r} is not supported (none | linear)")
  mapping = families.gguf_mapping(arch)
  if mapping.config is not None:
    config.update(mapping.config(require, config))
  return config


def _override_keys(argv: Sequence[str]) -> set[str]:
  return {arg.split("=", 1)[0].strip() for arg in argv if "=" in arg}


def load_gguf_config(
    path: str | os.PathLike, argv: Sequence[str] = (), **overrides: Any
) -> ml_collections.FrozenConfigDict:
  """The package config of a GGUF file: base.yml, then the file's model keys, then `argv` and `overrides`.

  `gguf_model_path` is set to `path`.

  Raises:
    FileNotFoundError, GGUFError, NotImplementedError: see `GGUFFile` and `gguf_to_hf_config`.
    ConfigError: an override is unknown or inconsistent.
  """
  derived = hf_config.hf_config_to_overrides(gguf_to_hf_config(open_gguf(path)))
  derived["gguf_model_path"] = os.fspath(path)
  given = _override_keys(argv) | set(overrides)
  merged = {k: v for k, v in derived.items() if k not in given}
  merged.update(overrides)
  return load_config(argv, **merged)


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Inverts llama.cpp's per-head row permutation of attn_q / attn_k (first axis: heads * head_dim rows).

  llama.cpp stores row `2 j + r` of a head at the place of Hugging Face row `r * head_dim / 2 + j` (r = 0, 1: the
  two rotary halves interleaved); this puts every row back.
  """
  rows = w.shape[0]
  half = rows // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _listing(names: Sequence[str]) -> str:
  shown = ", ".join(names[:_MAX_LISTED])
  return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _validate(file: GGUFFile, recipes: list[hf_layout.Recipe]) -> None:
  """Every needed tensor is present with its expected shape, and no tensor is left unused."""
  needed = {source for recipe in recipes for source in recipe.sources}
  missing = [
      f"{source!r} (expected shape {shape})"
      for recipe in recipes
      for source, shape in zip(recipe.sources, recipe.source_shapes)
      if source not in file.tensors
  ]
  if missing:
    raise GGUFError(f"{file.path} is missing {len(missing)} tensors (Hugging Face names): {_listing(missing)}")
  unexpected = sorted(f"{t.gguf_name!r} (shape {t.shape})" for name, t in file.tensors.items() if name not in needed)
  if unexpected:
    raise GGUFError(f"{file.path} has {len(unexpected)} tensors this model does not use: {_listing(unexpected)}")
  for recipe in recipes:
    for source, shape in zip(recipe.sources, recipe.source_shapes):
      tensor = file.tensors[source]
      if tensor.shape != shape:
        raise GGUFError(
            f"{file.path}: tensor {tensor.gguf_name!r} ({source}) has shape {tensor.shape} in Hugging Face order,"
            f" but the config expects {shape}"
        )


def _reader(file: GGUFFile, cfg: Any, dtype: np.dtype):
  permute = {}
  mapping = families.gguf_mapping(file.architecture)
  norm_shift = mapping.norm_shift if mapping is not None else 0.0
  if mapping is not None and mapping.permuted_rope_rows:
    for i in range(cfg.base_num_decoder_layers):
      permute[f"model.layers.{i}.self_attn.q_proj.weight"] = cfg.base_num_query_heads
      permute[f"model.layers.{i}.self_attn.k_proj.weight"] = cfg.base_num_kv_heads
      permute[f"model.layers.{i}.self_attn.q_proj.bias"] = cfg.base_num_query_heads
      permute[f"model.layers.{i}.self_attn.k_proj.bias"] = cfg.base_num_kv_heads

  def read(name: str) -> np.ndarray:
    if norm_shift and name.endswith("norm.weight"):  # small vectors: shifted in float32, then cast
      return (file.read(name, np.float32) - np.float32(norm_shift)).astype(dtype)
    array = file.read(name, dtype)
    return _unpermute_rope_rows(array, permute[name]) if name in permute else array

  return read


def iter_gguf_params(
    path: str | os.PathLike, cfg: ml_collections.FrozenConfigDict, *, progress: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
  """Streams the canonical parameters of a GGUF file, one at a time, in `cfg.weight_dtype`.

  Presence and shape of every tensor are checked (from the header) before the first one is dequantized.

  Args:
    path: the .gguf file.
    cfg: the model's config (e.g. from `load_gguf_config`).
    progress: show a tqdm progress bar on stderr.

  Returns:
    An iterator of (canonical name, numpy array of dtype `cfg.weight_dtype`).

  Raises:
    FileNotFoundError, GGUFError: see `GGUFFile`; GGUFError also for a missing, unexpected or mis-shaped tensor.
    NotImplementedError: an unsupported architecture or tensor type (`check_loadable`).
  """
  file = open_gguf(path)
  check_loadable(file)
  recipes = hf_layout.build_recipes(cfg, file.tensors.keys())
  _validate(file, recipes)
  dtype = np.dtype(jnp.dtype(cfg.weight_dtype))
  return _stream(file, recipes, dtype, _reader(file, cfg, dtype), progress)


def _stream(file, recipes, dtype, read, progress) -> Iterator[tuple[str, np.ndarray]]:
  desc = f"Loading {os.path.basename(file.path)}"
  total = sum(len(r.sources) for r in recipes)
  with tqdm.tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not progress) as progress_bar:
    for recipe in recipes:
      arrays = recipe.convert(lambda j, r=recipe: read(r.sources[j]), dtype)
      progress_bar.update(len(recipe.sources))
      for (name, shape), array in zip(recipe.targets, arrays):
        assert array.shape == shape and array.dtype == dtype, (name, array.shape, shape, array.dtype)
        yield name, array


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerParts:
  """What a GGUF file says about its tokenizer."""

  tokenizer: Any  # tokenizers.Tokenizer
  bos_token_id: int | None
  eos_token_id: int | None
  add_bos_token: bool
  chat_template: str | None


def _pre_tokenizer(pre: str, path: str) -> tuple[Any, Any]:
  """(normalizer, pre-tokenizer) of a byte-level vocabulary whose tokenizer.ggml.pre is `pre`."""
  from tokenizers import Regex, normalizers, pre_tokenizers  # pylint: disable=import-outside-toplevel  # hf extra

  if pre not in _SPLITS:
    raise NotImplementedError(
        f"{path}: tokenizer.ggml.pre={pre!r} is not supported (supported: {', '.join(sorted(_SPLITS))}); give a"
        " tokenizer.json with tokenizer_path="
    )
  split = _SPLITS[pre]
  if split is None:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if split == "digits":
    steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    return None, pre_tokenizers.Sequence(steps)
  steps = [
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ]
  return (normalizers.NFC() if pre == "qwen2" else None), pre_tokenizers.Sequence(steps)


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> Any:
  """The byte-level BPE tokenizer (`gpt2` model) of `tokens` and the file's merges and pre-tokenizer."""
  from tokenizers import Tokenizer, decoders, models  # pylint: disable=import-outside-toplevel  # hf extra

  merges = file.field("tokenizer.ggml.merges")
  if not merges:
    raise GGUFError(f"{file.path}: tokenizer.ggml.tokens and tokenizer.ggml.merges must both be set")
  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(merge.split(" ", 1)) for merge in merges]
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  normalizer, pre_tokenizer = _pre_tokenizer(str(file.field("tokenizer.ggml.pre", "default")), file.path)
  if normalizer is not None:
    tokenizer.normalizer = normalizer
  tokenizer.pre_tokenizer = pre_tokenizer
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _vocabulary_order_merges(pieces: Sequence[str]) -> list[tuple[str, str]]:
  """Every split of a piece into two pieces of the vocabulary, best first: a piece earlier in the vocabulary merges
  first (SentencePiece BPE lists pieces in merge order), and of one piece's splits the one with the longer left."""
  index = {piece: i for i, piece in enumerate(pieces)}
  merges = []
  for piece in sorted(index, key=index.__getitem__):
    for cut in range(len(piece) - 1, 0, -1):
      if piece[:cut] in index and piece[cut:] in index:
        merges.append((piece[:cut], piece[cut:]))
  return merges


# The version of `_vocabulary_order_merges`' result kept on disk: part of a kept file's name, so a change of the
# rule that makes merges must change it.
_MERGES_VERSION = "vocabulary-order-1"


def merges_cache_folder() -> Path:
  """Where `cached_vocabulary_order_merges` keeps merges: `tokenizers/` in this package's cache folder
  (`$MAXTEXT_CACHE_DIR`, else `~/.cache/maxtext`)."""
  return user_cache.folder("tokenizers")


def cached_vocabulary_order_merges(pieces: Sequence[str], folder: Path | None = None) -> list[tuple[str, str]]:
  """`_vocabulary_order_merges(pieces)`, kept in `folder` (default `merges_cache_folder()`) as the pieces' ids.

  Making the merges of a 262,144-piece vocabulary takes about a second of Python; a start that finds them reads
  an int32 `[M, 2]` array instead. The file's name is a SHA-256 of the pieces and `_MERGES_VERSION`, so another
  vocabulary never reads it; a file that does not load as such an array of ids in range is made again and
  replaced. A folder that cannot be written only costs the next start the second again.
  """
  folder = merges_cache_folder() if folder is None else Path(folder)
  digest = hashlib.sha256("\0".join([_MERGES_VERSION, *pieces]).encode("utf-8")).hexdigest()
  path = folder / f"merges-{digest[:32]}.npy"
  with contextlib.suppress(OSError, ValueError):
    ids = np.load(path, allow_pickle=False)
    if (
        ids.dtype == np.int32
        and ids.ndim == 2
        and ids.shape[1] == 2
        and (ids.size == 0 or (ids.min() >= 0 and ids.max() < len(pieces)))
    ):
      pairs = np.asarray(pieces, dtype=object)[ids]  # [M, 2] of the pieces themselves: no int per id in Python
      return list(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist()))
  merges = _vocabulary_order_merges(pieces)
  index = {piece: i for i, piece in enumerate(pieces)}
  ids = np.asarray([(index[a], index[b]) for a, b in merges], np.int32).reshape(-1, 2)
  with contextlib.suppress(OSError):
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".merges-", suffix=".npy", dir=folder)
    try:
      with os.fdopen(fd, "wb") as f:
        np.save(f, ids, allow_pickle=False)
      os.chmod(partial, 0o644)  # mkstemp makes it private; the cache holds ordinary files
      os.replace(partial, path)
    finally:
      if os.path.exists(partial):
        os.remove(partial)
  return merges


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str]) -> Any:
  """The SentencePiece BPE tokenizer (`llama` model) of Gemma files: spaces written as U+2581, no space prefix,
  merges in vocabulary order (the file has none, and Gemma's scores do not follow its merge order), `<0xNN>` byte
  pieces for characters outside the vocabulary.

  A piece made only of spaces is stored with real spaces; it is looked up as U+2581s, as the text's spaces are.
  """
  from tokenizers import Tokenizer, decoders, models, normalizers  # pylint: disable=import-outside-toplevel  # hf extra

  if file.field("tokenizer.ggml.add_space_prefix", True):
    raise NotImplementedError(
        f"{file.path}: a SentencePiece vocabulary (tokenizer.ggml.model='llama') is supported without a space prefix"
        " only (tokenizer.ggml.add_space_prefix=false, as Gemma files have); give a tokenizer.json with"
        " tokenizer_path="
    )
  pieces = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
  unk = file.field("tokenizer.ggml.unknown_token_id")
  model = models.BPE(
      vocab={piece: i for i, piece in enumerate(pieces)},
      merges=cached_vocabulary_order_merges(pieces),
      unk_token=None if unk is None else pieces[int(unk)],
      fuse_unk=True,
      byte_fallback=True,
  )
  tokenizer = Tokenizer(model)
  tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
  tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
  return tokenizer


def load_gguf_tokenizer(path: str | os.PathLike | GGUFFile) -> GGUFTokenizerParts:
  """The tokenizer of a GGUF file, built with the `tokenizers` library from the file's vocabulary (and merges).

  Tokenizer models: byte-level BPE (`tokenizer.ggml.model = gpt2`, used by SmolLM, Llama 3 and Qwen) and
  SentencePiece BPE without a space prefix (`llama`, as Gemma files hold it; bos is added by default unless
  `tokenizer.ggml.add_bos_token` is false, as llama.cpp does). Tokens typed unknown or control are added as whole
  special tokens, user-defined ones as whole normal tokens (llama.cpp matches all three whole in the text).

  Raises:
    GGUFError: the file has no vocabulary, or a `gpt2` one no merges.
    NotImplementedError: another tokenizer model or pre-tokenizer, or a SentencePiece space prefix.
  """
  from tokenizers import AddedToken  # pylint: disable=import-outside-toplevel  # hf extra

  file = path if isinstance(path, GGUFFile) else open_gguf(path)
  kind = file.field("tokenizer.ggml.model")
  if kind not in ("gpt2", "llama"):
    raise NotImplementedError(
        f"{file.path}: tokenizer.ggml.model={kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece"
        " 'llama'); give a tokenizer.json with tokenizer_path="
    )
  tokens = file.field("tokenizer.ggml.tokens")
  if not tokens:
    raise GGUFError(f"{file.path}: tokenizer.ggml.tokens must be set")
  tokenizer = _byte_level_bpe(file, tokens) if kind == "gpt2" else _sentencepiece_bpe(file, tokens)
  types = file.field("tokenizer.ggml.token_type") or []
  # In the model's vocabulary (a SentencePiece run of spaces is looked up respelled: see `_sentencepiece_bpe`).
  user_defined = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and tokenizer.token_to_id(t) is not None]
  tokenizer.add_special_tokens(
      [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL)]
  )
  tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

  def special(kind: str) -> int | None:
    value = file.field(f"tokenizer.ggml.{kind}_token_id")
    return None if value is None else int(value)

  return GGUFTokenizerParts(
      tokenizer=tokenizer,
      bos_token_id=special("bos"),
      eos_token_id=special("eos"),
      add_bos_token=bool(file.field("tokenizer.ggml.add_bos_token", kind == "llama")),
      chat_template=file.field("tokenizer.chat_template"),
  )
