"""The CLI's prompts_file=, streaming text output, the max_target_length report and use_chat_template errors.

Token references are independent of the runner: the same random model built directly from the config, run greedily
with full-sequence forwards (as in decode_test.py).
"""

import io
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import decode, decode_run
from maxtext.configs import load_config
from maxtext.inference.engine import LLMEngine
from maxtext.models import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "base.yml")
EOS = 2
PAD_TO = 32
RUN = ["vocab_size=259", "max_target_length=32", "num_kv_blocks=16", "block_size=8", "max_num_seqs=4"]


@pytest.fixture(name="greedy", scope="module")
def fixture_greedy():
  """prompt ids -> greedy tokens of the RUN model (dense forward, stops at eos)."""
  cfg = load_config([BASE] + RUN)
  model = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(cfg.init_seed)))
  forward = jax.jit(lambda tokens: model(tokens[None])[0])

  def run(prompt, max_tokens):
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < cfg.max_target_length:
      padded = jnp.asarray(tokens + [0] * (PAD_TO - len(tokens)), jnp.int32)
      out.append(int(np.argmax(np.asarray(forward(padded)[len(tokens) - 1]))))
      tokens.append(out[-1])
      if out[-1] == EOS:
        break
    return out

  return run


def _ids(text):
  return [1] + [b + 3 for b in text.encode("utf-8")]


def _text(ids):
  return bytes(t - 3 for t in ids if 3 <= t < 259).decode("utf-8", errors="replace")


def test_jsonl_prompts_are_decoded_together_in_input_order(tmp_path, capsys, greedy):
  lines = ['{"prompt": "I love"}', "", '{"prompt_token_ids": [7, 8, 9, 10, 11, 12]}', '{"prompt": "Hi"}']
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  args = [BASE] + RUN + [f"prompts_file={path}", "max_new_tokens=4", "output_format=json"]
  assert decode.main(args) == 0
  doc = json.loads(capsys.readouterr().out)
  prompts = [_ids("I love"), [7, 8, 9, 10, 11, 12], _ids("Hi")]
  assert [r["prompt_token_ids"] for r in doc["requests"]] == prompts
  assert [r["output_token_ids"] for r in doc["requests"]] == [greedy(p, 4) for p in prompts]
  # Decoded together: the steps of one run, not three (each prompt prefills in the first step).
  assert doc["stats"]["steps"] == max(len(greedy(p, 4)) for p in prompts)


@pytest.mark.slow
def test_text_prompts_file_prints_each_completion_under_its_line(tmp_path, capsys, greedy):
  path = tmp_path / "prompts.txt"
  path.write_text("I love\n\nHello there\n", encoding="utf-8")
  assert decode.main([BASE] + RUN + [f"prompts_file={path}", "max_new_tokens=3"]) == 0
  expected = [_text(greedy(_ids("I love"), 3)), _text(greedy(_ids("Hello there"), 3))]
  assert (
      capsys.readouterr().out == f"=== prompt 0 (line 1) ===\n{expected[0]}\n=== prompt 1 (line 3) ===\n{expected[1]}\n"
  )


def _bars(err: str) -> list[str]:
  """Each drawing of the decode's progress bar (tqdm redraws it in place with carriage returns)."""
  return [part for part in err.replace("\n", "\r").split("\r") if part.startswith("generating")]


@pytest.mark.parametrize(
    "cap, first, last",
    [
        # Without max_new_tokens a request runs until eos: the bar counts the 2 requests, not 31 + 29 tokens.
        ([], " 0/2 ", " 2/2 "),
        # Within max_new_tokens=3 the bar counts the 3 + 3 tokens that can be generated.
        (["max_new_tokens=3"], " 0/6 ", " 6/6 "),
    ],
)
def test_a_prompts_file_bar_counts_what_will_be_done_and_ends_at_100_percent(tmp_path, capsys, cap, first, last):
  path = tmp_path / "prompts.txt"
  path.write_text("I\nHi t\n", encoding="utf-8")
  assert decode.main([BASE] + RUN + [f"prompts_file={path}", *cap]) == 0
  bars = _bars(capsys.readouterr().err)
  assert first in bars[0], f"the bar's first total must be what the run will do ({first.strip()}), got {bars[0]!r}"
  assert bars[-1].startswith("generating: 100%") and last in bars[-1], bars[-1]


def test_a_malformed_line_is_reported_and_nothing_is_decoded(tmp_path, capsys, monkeypatch):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "ok"}\n{"prompt": "also ok"}\n{"prompt": 3}\n', encoding="utf-8")

  def no_model(*args, **kwargs):
    raise AssertionError(f"the model must not be built: LLM{args}{kwargs}")

  monkeypatch.setattr(decode_run, "LLM", no_model)
  assert decode.main([BASE] + RUN + [f"prompts_file={path}"]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert (
      captured.err == f"maxtext-decode: error: prompts_file {path} line 3: 'prompt' must be a non-empty string, got 3\n"
  )


def test_prompts_file_and_prompt_token_ids_are_exclusive(tmp_path, capsys):
  path = tmp_path / "p.txt"
  path.write_text("x\n", encoding="utf-8")
  assert decode.main([BASE] + RUN + [f"prompts_file={path}", "prompt_token_ids=[5]"]) == 2
  assert capsys.readouterr().err == "maxtext-decode: error: prompts_file and prompt_token_ids are both set; set one\n"


class _Recorder(io.StringIO):

  def __init__(self):
    super().__init__()
    self.chunks = []

  def write(self, s):
    self.chunks.append(s)
    return super().write(s)


def test_a_single_text_prompt_streams_token_by_token(monkeypatch, capsys, greedy):
  expected = greedy(_ids("I love"), 6)
  recorder = _Recorder()
  monkeypatch.setattr(sys, "stdout", recorder)
  assert decode.main([BASE] + RUN + ["prompt=I love", "max_new_tokens=6"]) == 0
  assert recorder.getvalue() == _text(expected) + "\n"
  printable = [t for t in expected if 3 + 0x20 <= t < 3 + 0x7F]  # an ASCII byte token is final text at once
  assert len(recorder.chunks) >= len(printable) + 1
  assert "generating" not in capsys.readouterr().err  # no progress bar under streamed text


@pytest.mark.slow
def test_max_new_tokens_beyond_max_target_length_is_reported_once(tmp_path, capsys, greedy):
  path = tmp_path / "p.txt"
  path.write_text("I love\nHello there\n", encoding="utf-8")
  assert decode.main([BASE] + RUN + [f"prompts_file={path}", "max_new_tokens=40", "output_format=json"]) == 0
  captured = capsys.readouterr()
  doc = json.loads(captured.out)
  capped = [r for r in doc["requests"] if r["finish_reason"] == "length"]
  warnings = [line for line in captured.err.splitlines() if line.startswith("maxtext-decode: warning:")]
  assert [r["output_token_ids"] for r in doc["requests"]] == [greedy(_ids(p), 40) for p in ("I love", "Hello there")]
  assert capped  # the seeded random model does not stop at eos before max_target_length for these prompts
  assert len(warnings) == 1, captured.err
  assert "max_new_tokens=40 but max_target_length=32 leaves room for fewer tokens after 2 of 2 prompts" in warnings[0]


class _StepClock:
  """Counts engine steps (LLMEngine.step calls) so a test can tell when output was written."""

  def __init__(self, monkeypatch):
    self.steps = 0
    real_step = LLMEngine.step

    def counted(engine):
      self.steps += 1
      return real_step(engine)

    monkeypatch.setattr(LLMEngine, "step", counted)


class _TimedStdout(io.StringIO):
  """stdout that records the step count at every write and flush."""

  def __init__(self, clock):
    super().__init__()
    self.clock = clock
    self.events = []

  def write(self, s):
    self.events.append(("write", self.clock.steps, s))
    return super().write(s)

  def flush(self):
    self.events.append(("flush", self.clock.steps, ""))
    super().flush()


def _short_then_long_file(tmp_path, greedy):
  """A prompts file whose first answer ends long before its second: max_target_length=32 leaves room for 6 tokens
  after the 26-id prompt of line 1 and for 29 after "Hi" (line 2). Returns (path, expected tokens per line)."""
  long_prompt = list(range(3, 29))
  path = tmp_path / "prompts.jsonl"
  path.write_text(json.dumps({"prompt_token_ids": long_prompt}) + "\n" + json.dumps({"prompt": "Hi"}) + "\n")
  expected = [greedy(long_prompt, 1000), greedy(_ids("Hi"), 1000)]
  assert len(expected[0]) < len(expected[1]) - 5  # the seeded model's first answer ends well before the second
  return path, expected


def test_prompts_file_text_writes_each_completion_as_soon_as_it_is_ready(tmp_path, monkeypatch, greedy):
  path, expected = _short_then_long_file(tmp_path, greedy)
  clock = _StepClock(monkeypatch)
  stdout = _TimedStdout(clock)
  monkeypatch.setattr(sys, "stdout", stdout)
  assert decode.main([BASE] + RUN + [f"prompts_file={path}"]) == 0
  first, second = (
      f"=== prompt 0 (line 1) ===\n{_text(expected[0])}\n",
      f"=== prompt 1 (line 2) ===\n{_text(expected[1])}\n",
  )
  assert stdout.getvalue() == first + second
  kinds = [(kind, text) for kind, _, text in stdout.events]
  i = kinds.index(("write", first))
  assert kinds[i + 1] == ("flush", "")  # written whole, then flushed
  assert stdout.events[i + 1][1] < clock.steps  # before the second answer was finished


class _PipeReadOnce(io.TextIOBase):
  """stdout as a pipe whose reader takes what the first flush sent and exits, like `| head -2`."""

  def __init__(self, clock):
    self.clock = clock
    self.read_fd, self.write_fd = os.pipe()
    self.received = b""
    self.unread = False
    self.closed_at = None

  def fileno(self):
    return self.write_fd

  def write(self, s):
    self.unread = True
    return os.write(self.write_fd, s.encode("utf-8"))  # BrokenPipeError once the reader is gone

  def flush(self):
    """The reader takes everything written so far, then closes its end."""
    if self.read_fd is not None and self.unread:
      self.received = os.read(self.read_fd, 1 << 16)
      os.close(self.read_fd)
      self.read_fd, self.closed_at = None, self.clock.steps


def test_a_reader_that_went_away_stops_a_prompts_file_run_at_the_next_step(tmp_path, monkeypatch, greedy):
  path, expected = _short_then_long_file(tmp_path, greedy)
  clock = _StepClock(monkeypatch)
  stdout = _PipeReadOnce(clock)
  monkeypatch.setattr(sys, "stdout", stdout)
  try:
    assert decode.main([BASE] + RUN + [f"prompts_file={path}"]) == 1  # as for any reader that closed stdout
  finally:
    os.close(stdout.write_fd)
  assert stdout.received.decode() == f"=== prompt 0 (line 1) ===\n{_text(expected[0])}\n"
  assert clock.steps == stdout.closed_at + 1  # not on until the second answer's write


def _warnings(err):
  return [line for line in err.splitlines() if line.startswith("maxtext-decode: ")]


def test_without_max_new_tokens_a_completion_runs_until_eos_within_max_target_length(capsys, greedy):
  expected = greedy(_ids("I love"), 1000)  # stops at eos or at max_target_length=32
  assert len(expected) > 16 and EOS not in expected  # longer than the old default cap; cut by max_target_length
  assert decode.main([BASE] + RUN + ["prompt=I love", "output_format=json"]) == 0
  captured = capsys.readouterr()
  (request,) = json.loads(captured.out)["requests"]
  assert request["output_token_ids"] == expected and request["finish_reason"] == "length"
  assert _warnings(captured.err) == []  # JSON output tells it in finish_reason

  assert decode.main([BASE] + RUN + ["prompt=I love"]) == 0
  captured = capsys.readouterr()
  assert captured.out == _text(expected) + "\n"
  assert _warnings(captured.err) == [
      "maxtext-decode: warning: the answer stopped at max_target_length=32 (prompt + answer) without reaching eos;"
      " raise max_target_length"
  ]


def test_a_text_answer_cut_by_max_new_tokens_is_said_once(tmp_path, capsys, greedy):
  assert EOS not in greedy(_ids("I love"), 3)
  assert decode.main([BASE] + RUN + ["prompt=I love", "max_new_tokens=3"]) == 0
  assert _warnings(capsys.readouterr().err) == [
      "maxtext-decode: warning: the answer stopped at max_new_tokens=3 without reaching eos; raise it, or set it to"
      " 0 (the default) to stop only at eos or max_target_length=32"
  ]
  path = tmp_path / "prompts.txt"
  path.write_text("I love\nHello there\n", encoding="utf-8")
  assert EOS not in greedy(_ids("Hello there"), 3)
  assert decode.main([BASE] + RUN + [f"prompts_file={path}", "max_new_tokens=3"]) == 0
  (warning,) = _warnings(capsys.readouterr().err)
  assert warning.startswith("maxtext-decode: warning: 2 of 2 answers stopped at max_new_tokens=3 without reaching eos;")


def test_a_cap_announced_before_decoding_is_not_said_again(capsys, greedy):
  # max_target_length=32 leaves 25 tokens after the 7-token prompt: the warning before decoding says so; the answer
  # that stops there was not cut by max_new_tokens=100.
  assert EOS not in greedy(_ids("I love"), 100)
  assert decode.main([BASE] + RUN + ["prompt=I love", "max_new_tokens=100"]) == 0
  (warning,) = _warnings(capsys.readouterr().err)
  assert warning.startswith("maxtext-decode: warning: max_new_tokens=100 but max_target_length=32 leaves room for 25")


def test_use_chat_template_without_a_template_is_one_error(capsys):
  assert decode.main([BASE] + RUN + ["use_chat_template=true"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("maxtext-decode: error: use_chat_template=true but the byte-level tokenizer has no chat template")


def test_a_missing_gguf_file_names_the_fetch_script(capsys):
  assert decode.main([BASE, "model_name=smollm2-135m-instruct", "gguf_model_path=/nonexistent/model.gguf"]) == 2
  assert capsys.readouterr().err == (
      "maxtext-decode: error: GGUF file '/nonexistent/model.gguf' (gguf_model_path) does not exist; for the README's"
      " example model run `python scripts/fetch_example_model.py` first\n"
  )
