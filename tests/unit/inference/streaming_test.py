"""TextStreamer: text appears token by token, a cut multi-byte character is held back until complete."""

import io

from maxtext.inference.streaming import TextStreamer


class _Chunks(io.StringIO):
  """Records every write."""

  def __init__(self):
    super().__init__()
    self.chunks = []

  def write(self, s):
    self.chunks.append(s)
    return super().write(s)


def _utf8_decode(ids):
  return bytes(ids).decode("utf-8", errors="replace")


def test_tokens_stream_as_they_come_and_a_split_character_waits():
  out = _Chunks()
  streamer = TextStreamer(_utf8_decode, out)
  for token in "hé!".encode("utf-8"):  # é is two bytes: the first alone decodes to U+FFFD
    streamer.on_token(0, token)
  streamer.finish()
  assert out.chunks == ["h", "é", "!", "\n"]
  assert out.getvalue() == "hé!\n" and streamer.written == "hé!"


def test_a_cut_character_at_the_end_is_written_by_finish():
  out = _Chunks()
  streamer = TextStreamer(_utf8_decode, out)
  streamer.on_token(0, ord("a"))
  streamer.on_token(0, 0xC3)
  assert out.getvalue() == "a"
  streamer.finish()
  assert out.getvalue() == "a\ufffd\n"
