"""Prompt checks shared by the `LLM` API and the CLI, so both apply the same rules with the same words.

A prompt is a non-empty `str` of valid Unicode text (encodable as UTF-8: no lone surrogates, which is what
Python makes of command-line bytes that are not UTF-8), or a non-empty sequence of token ids (Python or NumPy
integers, not bools). Checking the ids against the vocabulary and `max_target_length` is the scheduler's job.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

_SURROGATE_ESCAPES = range(0xDC80, 0xDD00)  # how os.fsdecode represents undecodable bytes 0x80..0xff


def _is_token_id(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_prompt_sequence(value: Any) -> bool:
  return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def normalize_prompts(prompts: Any) -> list[Any]:
  """The prompts of one `generate` call as a list: a lone string or token-id list becomes a list of one.

  Args:
    prompts: a string, a sequence of token ids, a dict prompt (vLLM's `{"prompt": ...}` forms), or a sequence of
      those.

  Returns:
    The prompts, each a string or a sequence (checked by `check_prompt`).

  Raises:
    TypeError: `prompts` is none of the accepted forms (bytes, None, a number, ...).
  """
  if isinstance(prompts, (str, Mapping)):
    return [prompts]
  if isinstance(prompts, (bytes, bytearray)):
    raise TypeError(
        f"prompts must be a string, a list of token ids, a dict prompt, or a list of those; got {type(prompts).__name__}"
        " (decode bytes to str first, or pass list(...) for token ids)"
    )
  if not _is_prompt_sequence(prompts):
    raise TypeError(
        "prompts must be a string, a list of token ids, a dict prompt, or a list of those; got"
        f" {type(prompts).__name__} {prompts!r:.40}"
    )
  if prompts and _is_token_id(prompts[0]):
    return [prompts]
  return list(prompts)


def check_text(text: str, where: str) -> None:
  """Raises unless `text` is non-empty and valid Unicode (encodable as UTF-8).

  Args:
    text: the prompt text.
    where: the name in messages, e.g. "prompt" (the CLI key) or "prompts[2]" (the API argument).

  Raises:
    ValueError: the text is empty, or holds a character UTF-8 cannot encode (naming it and its position).
  """
  if not text:
    raise ValueError(f"{where} is empty; a prompt needs at least one character (or give token ids)")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    char = ord(text[e.start])
    what = f"byte 0x{char - 0xDC00:02x}" if char in _SURROGATE_ESCAPES else f"lone surrogate U+{char:04X}"
    raise ValueError(
        f"{where} is not valid UTF-8 text: {what} at character {e.start}; give UTF-8 text or token ids"
    ) from None


def check_prompt(prompt: Any, where: str) -> None:
  """Raises unless `prompt` is a valid text prompt (`check_text`) or a non-empty sequence of integers.

  Args:
    prompt: one prompt.
    where: the name in messages, e.g. "prompt_token_ids" or "prompts[0]".

  Raises:
    TypeError: neither a string nor a sequence of integers (naming the offending element's position).
    ValueError: an empty prompt, or text that is not valid UTF-8.
  """
  if isinstance(prompt, str):
    check_text(prompt, where)
    return
  if not _is_prompt_sequence(prompt):
    raise TypeError(f"{where} must be a string or a list of token ids, got {type(prompt).__name__}")
  if not prompt:
    raise ValueError(f"{where} is empty; a prompt needs at least one token")
  for i, token in enumerate(prompt):
    if not _is_token_id(token):
      raise TypeError(f"{where}[{i}] must be an int token id, got {type(token).__name__} {token!r}")


def num_generatable_tokens(num_prompt_tokens: int, max_tokens: int | None, max_target_length: int) -> int:
  """Tokens a request can generate: `max_tokens` (None: no bound of its own), or fewer when prompt + output would
  pass `max_target_length`."""
  room = max_target_length - num_prompt_tokens
  return max(0, room if max_tokens is None else min(max_tokens, room))


def check_sequence_of(items: Sequence[Any], kind: type, where: str) -> None:
  """Raises TypeError unless every item is a `kind` (used for per-prompt SamplingParams lists)."""
  for i, item in enumerate(items):
    if not isinstance(item, kind):
      raise TypeError(f"{where}[{i}] must be a {kind.__name__}, got {type(item).__name__}")
