"""Render a model's own chat template (Jinja, as in GGUF metadata or tokenizer_config.json) into prompt text.

The template runs in jinja2's immutable sandbox with the settings transformers uses for chat templates
(`trim_blocks`, `lstrip_blocks`, the `raise_exception` and `strftime_now` globals, a `tojson` filter that keeps
non-ASCII text), so a template renders here as it does there. Special tokens are whatever the template writes: the
rendered text is tokenized without adding bos / eos again.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn


class ChatTemplateError(ValueError):
  """A chat template is missing, does not parse, or fails while rendering."""


def _raise_exception(message: str) -> NoReturn:
  raise ChatTemplateError(f"the chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
  import jinja2  # pylint: disable=import-outside-toplevel  # optional dependency (the hf extra)
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(template)
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    source: str = "the model",
) -> str:
  """The prompt text of `messages` under `template`.

  Args:
    template: the Jinja source (None or "" = the model has none).
    messages: chat messages, each a mapping with "role" and "content" strings.
    bos_token, eos_token: the texts of the model's bos / eos tokens (templates may write them).
    add_generation_prompt: end with the header of an assistant turn, so the model writes the answer.
    source: where the template comes from, for error messages.

  Returns:
    The rendered text.

  Raises:
    ChatTemplateError: no template, a template that does not parse or raises, or malformed messages.
  """
  if not template:
    raise ChatTemplateError(
        f"use_chat_template=true but {source} has no chat template (GGUF metadata tokenizer.chat_template, or"
        " chat_template in tokenizer_config.json / chat_template.jinja of a Hugging Face folder)"
    )
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
      raise ChatTemplateError(f"messages[{i}] must be a mapping with a 'role' string, got {message!r}")
    if not isinstance(message.get("content"), str):
      raise ChatTemplateError(f"messages[{i}] must have a 'content' string, got {message.get('content')!r}")
  import jinja2  # pylint: disable=import-outside-toplevel  # optional dependency (the hf extra)

  compiled = _compile(template)
  try:
    return compiled.render(
        messages=[dict(m) for m in messages],
        bos_token=bos_token,
        eos_token=eos_token,
        add_generation_prompt=add_generation_prompt,
    )
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template of {source} failed to render: {e}") from None
