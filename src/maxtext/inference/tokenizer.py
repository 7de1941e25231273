"""Tokenizers: a byte-level one for tiny random models, Hugging Face `tokenizer.json` files (local only), and the
tokenizer a GGUF file describes.

All expose `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `bos_token_id`, `eos_token_id` and
`chat_template` (None when the model has none). `tokenizer_from_config(cfg)` applies base.yml's rule:
`tokenizer_path`, else the tokenizer of the checkpoint that supplies the model keys (`hf_model_path` or
`gguf_model_path`, see `maxtext.checkpoint.source`), else byte-level.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from maxtext.checkpoint import source

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
  """A tokenizer cannot be loaded from the given path."""


class ByteTokenizer:
  """UTF-8 bytes as tokens: id = byte + 3; ids 0, 1, 2 are pad, bos and eos.

  Decoding drops the special ids and ids that are no byte (>= 259: a random model may sample them), and replaces
  invalid UTF-8 with U+FFFD.

  Args:
    vocab_size: the model's vocabulary size (>= 259).
  """

  pad_token_id = 0
  bos_token_id = 1
  eos_token_id = 2
  offset = 3
  chat_template = None

  def __init__(self, vocab_size: int = 259):
    if vocab_size < 256 + self.offset:
      raise TokenizerError(
          f"the byte-level tokenizer needs vocab_size >= {256 + self.offset} (256 bytes + pad, bos, eos), got"
          f" {vocab_size}; set vocab_size or tokenizer_path"
      )
    self.vocab_size = vocab_size

  def encode(self, text: str, add_bos: bool = False, add_special_tokens: bool = True) -> list[int]:
    """Token ids of the UTF-8 bytes of `text` (with a leading bos when `add_bos`; there are no special tokens in
    text, so `add_special_tokens` changes nothing)."""
    del add_special_tokens
    ids = [b + self.offset for b in text.encode("utf-8")]
    return [self.bos_token_id] + ids if add_bos else ids

  def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of the byte tokens (specials and non-byte ids dropped whatever `skip_special_tokens` says: they have no
    text; invalid UTF-8 replaced)."""
    del skip_special_tokens
    data = bytes(int(t) - self.offset for t in token_ids if self.offset <= int(t) < 256 + self.offset)
    return data.decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face `tokenizers.Tokenizer` read from a local `tokenizer.json`.

  bos / eos come from `tokenizer_config.json` (`bos_token` / `eos_token`, a string or {"content": ...}) beside the
  file, else from `config.json`'s `bos_token_id` / `eos_token_id` (first entry of a list), else None. The chat
  template is `chat_template.jinja` beside the file, else `tokenizer_config.json`'s `chat_template` (a string, or a
  list of {"name", "template"} whose "default" entry is used), else None.

  Args:
    path: a `tokenizer.json` file or a folder holding one.

  Raises:
    TokenizerError: the path does not exist, the folder has no tokenizer.json, or the file cannot be parsed.
  """

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel  # optional dependency (hf extra)

    file = _tokenizer_file(path)
    try:
      self._tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-exception-caught  # tokenizers raises a bare Exception
      raise TokenizerError(f"{file}: not a valid tokenizer.json ({e})") from None
    self.path = file
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    folder = os.path.dirname(file)
    self.bos_token_id = self._special_id(folder, "bos")
    self.eos_token_id = self._special_id(folder, "eos")
    self.add_bos_token = True
    try:
      self.chat_template = source.folder_chat_template(folder)
    except ValueError as e:
      raise TokenizerError(str(e)) from None

  @classmethod
  def from_gguf(cls, path: str) -> "HFTokenizer":
    """The tokenizer a GGUF file describes (its vocabulary, merges, bos / eos, add_bos_token and chat template).

    Raises:
      FileNotFoundError, NotImplementedError, ValueError: see `maxtext.checkpoint.gguf.load_gguf_tokenizer`.
    """
    return cls.from_files(source.GGUFFile(path).tokenizer())

  @classmethod
  def from_files(cls, files: source.TokenizerFiles) -> "HFTokenizer":
    """The tokenizer a checkpoint source names: its tokenizer.json, or the one built from its metadata.

    Raises:
      TypeError: `files` is not a TokenizerFiles.
      TokenizerError: see `HFTokenizer`.
    """
    if not isinstance(files, source.TokenizerFiles):
      raise TypeError(f"HFTokenizer.from_files takes a TokenizerFiles, got {type(files).__name__}")
    if files.parts is None:
      return load_tokenizer(files.path)
    parts = files.parts
    tokenizer = cls.__new__(cls)
    tokenizer._tokenizer = parts.tokenizer  # pylint: disable=protected-access  # an alternative constructor
    tokenizer.path = files.path
    tokenizer.vocab_size = parts.tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.bos_token_id = parts.bos_token_id
    tokenizer.eos_token_id = parts.eos_token_id
    tokenizer.add_bos_token = parts.add_bos_token
    tokenizer.chat_template = parts.chat_template
    return tokenizer

  def token_text(self, token_id: int | None) -> str:
    """The vocabulary entry of `token_id` ("" for None or an unknown id), e.g. for a chat template's bos_token."""
    if token_id is None:
      return ""
    return self._tokenizer.id_to_token(int(token_id)) or ""

  def _special_id(self, folder: str, kind: str) -> int | None:
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    token = config.get(f"{kind}_token")
    if isinstance(token, dict):
      token = token.get("content")
    if isinstance(token, str):
      token_id = self._tokenizer.token_to_id(token)
      if token_id is not None:
        return int(token_id)
    token_id = _read_json(os.path.join(folder, "config.json")).get(f"{kind}_token_id")
    if isinstance(token_id, list):
      token_id = token_id[0] if token_id else None
    return None if token_id is None else int(token_id)

  def encode(self, text: str, add_bos: bool = False, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (the tokenizer's own post-processor decides about special tokens unless
    `add_special_tokens` is false, as for a rendered chat template; `add_bos` prepends bos when the tokenizer has one,
    adds it by default (a GGUF file's add_bos_token) and did not add it)."""
    ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    wants_bos = add_bos and self.add_bos_token and self.bos_token_id is not None
    if wants_bos and (not ids or ids[0] != self.bos_token_id):
      ids.insert(0, self.bos_token_id)
    return ids

  def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of the ids, special tokens skipped unless `skip_special_tokens` is false."""
    return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)


def _tokenizer_file(path: str) -> str:
  if not path:
    raise TokenizerError("tokenizer path is empty; give a tokenizer.json file or a folder holding one")
  if os.path.isdir(path):
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
      raise TokenizerError(
          f"{path} has no {TOKENIZER_FILE}; only local tokenizer.json files are supported (save one with"
          " transformers' tokenizer.save_pretrained)"
      )
    return file
  if not os.path.isfile(path):
    raise TokenizerError(f"tokenizer path {path} does not exist (the hub is never queried; give a local path)")
  return path


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise TokenizerError(f"{path}: not valid JSON ({e})") from None
  return data if isinstance(data, dict) else {}


def load_tokenizer(path: str) -> HFTokenizer:
  """Loads a local Hugging Face tokenizer (`tokenizer.json` file or a folder holding one).

  Raises:
    TokenizerError: see `HFTokenizer`.
  """
  tokenizer = HFTokenizer(path)
  logger.info("loaded tokenizer %s (vocab %d)", tokenizer.path, tokenizer.vocab_size)
  return tokenizer


def tokenizer_from_config(cfg: Any) -> ByteTokenizer | HFTokenizer:
  """`cfg.tokenizer_path`, else the tokenizer of the model source (`cfg.hf_model_path`'s tokenizer.json or
  `cfg.gguf_model_path`'s vocabulary), else a byte-level tokenizer of `cfg.vocab_size`.

  Raises:
    ConfigError: both hf_model_path and gguf_model_path are set.
    TokenizerError: the chosen path cannot be loaded, a tokenizer has more ids than `vocab_size`, or the byte
      tokenizer does not fit `vocab_size`.
  """
  if cfg.tokenizer_path:
    tokenizer = load_tokenizer(cfg.tokenizer_path)
  else:
    checkpoint = source.model_source(cfg)
    files = None if checkpoint is None else checkpoint.tokenizer()
    if files is None:
      return ByteTokenizer(int(cfg.vocab_size))
    tokenizer = HFTokenizer.from_files(files)
  if tokenizer.vocab_size > int(cfg.vocab_size):
    raise TokenizerError(
        f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}"
    )
  return tokenizer
