"""The CLI's handling of bad input and interruptions (in-process): one line on stderr, a defined exit status.

decode_test.py covers outputs and the common bad keys; this file covers the prompt and sampling rules shared with
the API (same rule, the CLI's key name), the model-source conflicts and the exit paths of `main`.
"""

import gc
import json
import os
import pathlib
import signal
import sys

import pytest

from maxtext import decode

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "base.yml")
RUN = [BASE, "vocab_size=259", "max_target_length=32", "num_kv_blocks=16", "block_size=8", "max_num_seqs=2"]


def _error_line(capsys):
  captured = capsys.readouterr()
  assert captured.out == ""
  lines = captured.err.splitlines()
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("maxtext-decode: error: "), lines
  return lines[0][len("maxtext-decode: error: ") :]


@pytest.mark.parametrize(
    "args, message",
    [
        # Python hands undecodable argv bytes over as surrogate escapes (b"\xff" -> "\udcff").
        (["prompt=ab\udcff"], "prompt is not valid UTF-8 text: byte 0xff at character 2; give UTF-8 text or token ids"),
        (["prompt=\ud800"], "prompt is not valid UTF-8 text: lone surrogate U+D800 at character 0"),
        (["max_new_tokens=-1"], "max_new_tokens=-1: must be >= 0 (0 = until eos, within max_target_length)"),
        (["max_new_tokens=-3"], "max_new_tokens=-3: must be >= 0"),
        (
            ["hf_model_path=/nonexistent", "model_name=llama-tiny"],
            "hf_model_path='/nonexistent' and model_name='llama-tiny' both name the model; set one",
        ),
    ],
)
def test_bad_prompt_and_sampling_keys_name_the_key(capsys, args, message):
  assert decode.main([BASE] + args) == 2
  assert _error_line(capsys).startswith(message)


def test_hf_model_path_that_is_a_file_says_it_is_not_a_folder(capsys, tmp_path):
  path = tmp_path / "model.safetensors"
  path.write_bytes(b"\x00" * 8)
  assert decode.main([BASE, f"hf_model_path={path}"]) == 2
  assert _error_line(capsys).startswith(f"hf_model_path='{path}' is a file, not a folder")


def test_gguf_model_path_that_is_a_folder_says_it_is_not_a_gguf_file(capsys, tmp_path):
  (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
  assert decode.main([BASE, f"gguf_model_path={tmp_path}", "prompt=Hi"]) == 2
  line = _error_line(capsys)
  assert line.startswith(f"gguf_model_path='{tmp_path}' is a folder, not a GGUF file;"), line
  assert line.endswith("it holds model.Q4_1.gguf") and "does not exist" not in line


def test_a_hugging_face_folder_given_as_gguf_model_path_points_at_hf_model_path(capsys, tmp_path):
  (tmp_path / "config.json").write_text("{}", encoding="utf-8")
  assert decode.main([BASE, f"gguf_model_path={tmp_path}", "prompt=Hi"]) == 2
  assert _error_line(capsys) == (
      f"gguf_model_path='{tmp_path}' is a folder, not a GGUF file; give the path of the .gguf file itself; it holds"
      " no .gguf file but a config.json: a Hugging Face folder is given as hf_model_path"
  )


def test_a_gguf_file_given_as_hf_model_path_points_at_gguf_model_path(capsys, tmp_path):
  path = tmp_path / "model.Q4_1.gguf"
  path.write_bytes(b"GGUF")
  assert decode.main([BASE, f"hf_model_path={path}", "prompt=Hi"]) == 2
  line = _error_line(capsys)
  assert line.startswith(f"hf_model_path='{path}' is a file, not a folder;"), line
  assert line.endswith("; a GGUF file is given as gguf_model_path"), line
  other = tmp_path / "model.bin"
  other.write_bytes(b"\x00")
  assert decode.main([BASE, f"hf_model_path={other}", "prompt=Hi"]) == 2
  assert "gguf_model_path" not in _error_line(capsys)  # only a .gguf file is pointed elsewhere


def test_a_model_source_set_by_the_model_config_is_named_as_such(capsys, tmp_path):
  assert decode.main([BASE, "model_name=smollm2-135m-instruct", f"hf_model_path={tmp_path}", "prompt=Hi"]) == 2
  line = _error_line(capsys)
  assert line.startswith(
      f"the command line sets hf_model_path='{tmp_path}' and model_name=smollm2-135m-instruct sets gguf_model_path="
  ), line
  assert line.endswith("drop model_name=smollm2-135m-instruct (its model config names gguf_model_path) or hf_model_path")


def test_a_run_that_cannot_fit_in_memory_is_one_line_naming_the_figures(capsys, monkeypatch):
  monkeypatch.setenv("MAXTEXT_MEMORY_LIMIT_BYTES", "15000000")
  assert decode.main([BASE, "model_name=qwen3-next-tiny", "prompt=Hi", "max_new_tokens=2"]) == 2
  line = _error_line(capsys)
  assert line.startswith("model_name=qwen3-next-tiny needs 21.22 MiB (parameters 3.77 MiB: float32"), line
  assert "but 14.31 MiB is available (MAXTEXT_MEMORY_LIMIT_BYTES); use a KV cache within the 9.50 MiB left" in line


@pytest.mark.slow
def test_max_new_tokens_beyond_max_target_length_is_said_once_and_capped(capsys):
  # "I love" is bos + 6 bytes = 7 tokens, so max_target_length=32 leaves room for 25.
  status = decode.main(RUN + ["prompt=I love", "max_new_tokens=100000000", "output_format=json"])
  captured = capsys.readouterr()
  assert status == 0, captured.err
  warnings = [line for line in captured.err.splitlines() if line.startswith("maxtext-decode: ")]
  assert warnings == [
      "maxtext-decode: warning: max_new_tokens=100000000 but max_target_length=32 leaves room for 25 tokens after"
      " the 7-token prompt; generating at most 25"
  ]
  (request,) = json.loads(captured.out)["requests"]
  assert len(request["prompt_token_ids"]) == 7
  assert len(request["output_token_ids"]) == 25 or request["finish_reason"] == "stop"
  # max_tokens reaches past max_target_length: the bar counts the request, and ends at it with the tokens it made.
  assert "100%|██████████| 1/1" in captured.err and f"{len(request['output_token_ids'])} tok]" in captured.err


def test_max_new_tokens_that_fits_prints_no_warning(capsys):
  assert decode.main(RUN + ["prompt=I love", "max_new_tokens=25", "output_format=json"]) == 0
  assert "maxtext-decode: warning" not in capsys.readouterr().err


def test_help_describes_the_json_shape_with_finish_reason(capsys):
  assert decode.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert '"prompt_token_ids", "output_token_ids", "text", "finish_reason", "logprobs"' in out
  assert "Ctrl-C exits with status 130" in out


def test_keyboard_interrupt_exits_130_with_one_line(capsys, monkeypatch):
  def interrupted(argv, cancel):
    del argv
    assert not cancel.is_set()
    raise KeyboardInterrupt

  monkeypatch.setattr(decode, "run", interrupted)
  assert decode.main([BASE]) == 130
  captured = capsys.readouterr()
  assert captured.err == "maxtext-decode: interrupted\n" and captured.out == ""


def test_ctrl_c_sets_the_cancel_event_even_if_the_interrupt_is_lost(capsys, monkeypatch):
  # Native code running when the signal lands can swallow the KeyboardInterrupt; the event the handler also sets
  # is what LLM.generate checks before each step.
  def swallowed(argv, cancel):
    del argv
    try:
      os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
      pass  # lost, as inside an XLA call
    assert cancel.is_set()
    raise KeyboardInterrupt("generate cancelled")  # what generate raises at its next step

  before = signal.getsignal(signal.SIGINT)
  monkeypatch.setattr(decode, "run", swallowed)
  assert decode.main([BASE]) == 130
  assert capsys.readouterr().err == "maxtext-decode: interrupted\n"
  assert signal.getsignal(signal.SIGINT) is before  # the handler is restored


def test_ctrl_c_inside_a_gc_callback_only_sets_the_cancel_event(capsys, monkeypatch):
  # Raised inside a gc callback, KeyboardInterrupt would be printed as "Exception ignored" with a traceback and
  # swallowed; the handler leaves it to the event there, and raises everywhere else.
  def interrupted_during_gc(argv, cancel):
    del argv
    seen = []

    def callback(phase, info):
      del info
      if phase == "start" and not seen:
        seen.append(phase)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())  # pylint: disable=protected-access

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # where an exception in a gc callback goes
    gc.callbacks.append(callback)
    try:
      gc.collect()
    finally:
      gc.callbacks.remove(callback)
    assert seen and cancel.is_set() and not unraisable
    with pytest.raises(KeyboardInterrupt):
      signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())  # pylint: disable=protected-access
    raise KeyboardInterrupt("generate cancelled")

  monkeypatch.setattr(decode, "run", interrupted_during_gc)
  assert decode.main([BASE]) == 130
  assert capsys.readouterr().err == "maxtext-decode: interrupted\n"


@pytest.mark.parametrize("error", [PermissionError("permission denied: 'x.yml'"), IsADirectoryError("x is a dir")])
def test_os_errors_are_user_errors(capsys, monkeypatch, error):
  def failing(argv, cancel):
    del argv, cancel
    raise error

  monkeypatch.setattr(decode, "run", failing)
  assert decode.main([BASE]) == 2
  assert _error_line(capsys) == str(error)


def test_broken_pipe_exits_1_without_an_error_line(capsys, monkeypatch):
  def reader_gone(argv, cancel):
    del argv, cancel
    raise BrokenPipeError(32, "Broken pipe")

  monkeypatch.setattr(decode, "run", reader_gone)
  assert decode.main([BASE]) == 1
  assert capsys.readouterr().err == ""
