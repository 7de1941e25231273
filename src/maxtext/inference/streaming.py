"""Print a completion while it is generated: incremental detokenization of a growing list of token ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO

_INCOMPLETE = "\ufffd"  # what a decoder makes of a UTF-8 sequence whose last bytes have not been generated yet


class TextStreamer:
  """Writes the text of each new token to `stream` as soon as it is final.

  Every call decodes all ids so far and writes what extends the text already written. Text ending in U+FFFD (a
  multi-byte character cut in the middle) is held back until the next token completes it; `finish` writes the rest.

  Args:
    decode: ids -> text (e.g. a tokenizer's `decode`).
    stream: where to write (flushed after each write).
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stream: TextIO):
    self._decode = decode
    self._stream = stream
    self._ids: list[int] = []
    self.written = ""

  def _write(self, text: str) -> None:
    if text.startswith(self.written) and len(text) > len(self.written):
      self._stream.write(text[len(self.written) :])
      self._stream.flush()
      self.written = text

  def on_token(self, index: int, token_id: int) -> None:
    """`LLM.generate`'s `on_token` callback (a single prompt: `index` is 0)."""
    del index
    self._ids.append(int(token_id))
    text = self._decode(self._ids)
    if not text.endswith(_INCOMPLETE):
      self._write(text)

  def finish(self) -> None:
    """Writes whatever was held back, then a newline."""
    self._write(self._decode(self._ids))
    self._stream.write("\n")
    self._stream.flush()
