"""Read the CLI's `prompts_file=`: one prompt per line, or JSON Lines with "prompt" or "prompt_token_ids".

The file is read and checked whole before anything is decoded: a malformed line raises `PromptsFileError` naming its
line number. Blank lines are skipped. The format is JSON Lines when the first non-blank line starts with "{"; then
every line must be a JSON object with exactly one of "prompt" (a non-empty string) and "prompt_token_ids" (a
non-empty list of non-negative ints). Otherwise every line is one text prompt, taken as written (without its newline).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")


class PromptsFileError(ValueError):
  """A prompts file is missing, empty or has a malformed line."""


@dataclasses.dataclass(frozen=True)
class FilePrompt:
  """One prompt of a prompts file: its 1-based line number and the prompt (text or token ids)."""

  line: int
  prompt: str | list[int]


def _json_prompt(path: str, number: int, text: str) -> str | list[int]:
  where = f"prompts_file {path} line {number}"
  try:
    record: Any = json.loads(text)
  except json.JSONDecodeError as e:
    raise PromptsFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); the file is JSON Lines") from None
  if not isinstance(record, dict):
    raise PromptsFileError(f"{where}: must be a JSON object with 'prompt' or 'prompt_token_ids', got {text.strip()}")
  unknown = sorted(set(record) - set(PROMPT_KEYS))
  given = [key for key in PROMPT_KEYS if key in record]
  if unknown or len(given) != 1:
    raise PromptsFileError(
        f"{where}: must hold exactly one of 'prompt' and 'prompt_token_ids' and no other key, got keys {sorted(record)}"
    )
  value = record[given[0]]
  if given[0] == "prompt":
    if not isinstance(value, str) or not value:
      raise PromptsFileError(f"{where}: 'prompt' must be a non-empty string, got {value!r}")
    return value
  is_ids = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
  if not is_ids or not value:
    raise PromptsFileError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative ints, got {value!r}")
  return list(value)


def read_prompts_file(path: str) -> list[FilePrompt]:
  """The prompts of `path`, in file order (see the module docstring for the format).

  Raises:
    PromptsFileError: the file does not exist, holds no prompt, or has a malformed line (its number is named).
  """
  if not os.path.isfile(path):
    raise PromptsFileError(f"prompts_file {path!r} does not exist")
  with open(path, encoding="utf-8") as f:
    try:
      lines = f.read().splitlines()
    except UnicodeDecodeError as e:
      raise PromptsFileError(f"prompts_file {path}: not UTF-8 text ({e})") from None
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  if not numbered:
    raise PromptsFileError(f"prompts_file {path} holds no prompt (every line is blank)")
  is_jsonl = numbered[0][1].lstrip().startswith("{")
  if not is_jsonl:
    return [FilePrompt(number, line) for number, line in numbered]
  return [FilePrompt(number, _json_prompt(path, number, line)) for number, line in numbered]
