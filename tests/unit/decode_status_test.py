"""The CLI's status lines: on a terminal, the first line comes before the imports and the engine's status records
follow it; a pipe gets none of them. The engine's compile notice while its first step is slow."""

import io
import json
import logging
import os
import pathlib
import pty
import select
import subprocess
import sys
import threading

import pytest

from maxtext import decode
from maxtext.configs import load_config
from maxtext.inference import engine as engine_module

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(name="status_logger")
def fixture_status_logger():
  """The `maxtext.status` logger, restored after the test (show_status adds a handler and stops propagation)."""
  status = logging.getLogger(decode.STATUS_LOGGER)
  saved = (list(status.handlers), status.level, status.propagate)
  yield status
  status.handlers[:], status.level, status.propagate = saved[0], saved[1], saved[2]


def test_show_status_writes_the_starting_line_then_each_status_record(status_logger):
  stream = io.StringIO()
  decode.show_status(stream)
  assert stream.getvalue() == decode.STARTING + "\n"
  engine_module.status.info("loading the weights")
  logging.getLogger("maxtext.other").info("not a status record")
  assert stream.getvalue().splitlines() == [decode.STARTING, "maxtext-decode: loading the weights"]
  assert not status_logger.propagate  # the root logger's warning handler does not print them again


def _run_cli(args, stderr_tty):
  """Runs the CLI program; returns (status, stdout, stderr) with stderr a terminal (a pty) or a pipe."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
  cmd = [sys.executable, "-m", "maxtext.decode", *args]
  if not stderr_tty:
    result = subprocess.run(cmd, capture_output=True, env=env, check=False, timeout=600)
    return result.returncode, result.stdout.decode(), result.stderr.decode()
  leader, follower = pty.openpty()
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=follower, env=env) as proc:
    os.close(follower)
    err = b""
    while True:
      ready, _, _ = select.select([leader], [], [], 600)
      if not ready:
        proc.kill()
        raise AssertionError(f"no output within 600 s: {err!r}")
      try:
        chunk = os.read(leader, 4096)
      except OSError:  # the child closed the terminal
        break
      if not chunk:
        break
      err += chunk
    out = proc.stdout.read().decode()
    status = proc.wait(timeout=600)
  os.close(leader)
  return status, out, err.decode().replace("\r\n", "\n")


ARGS = [
    "configs/base.yml",
    "model_name=llama-tiny",
    "max_new_tokens=2",
    "prompt_token_ids=[1, 2, 3]",
    "output_format=json",
]


@pytest.mark.slow  # a fresh interpreter imports JAX and compiles a tiny model's step
def test_on_a_terminal_the_starting_line_comes_first_and_a_pipe_gets_none():
  status, out, err = _run_cli(ARGS, stderr_tty=True)
  assert status == 0, err
  assert err.startswith(decode.STARTING + "\n"), err
  assert len(json.loads(out)["requests"][0]["output_token_ids"]) == 2  # the completion, on stdout
  status, piped_out, piped_err = _run_cli(ARGS, stderr_tty=False)
  assert status == 0 and json.loads(piped_out)["requests"] == json.loads(out)["requests"]
  assert "maxtext-decode: starting" not in piped_err


@pytest.mark.slow
def test_the_help_prints_no_status_line_on_a_terminal():
  status, out, err = _run_cli(["--help"], stderr_tty=True)
  assert status == 0 and out.startswith("usage: maxtext-decode") and err == ""


def test_a_slow_first_step_logs_the_compile_notice(status_logger, monkeypatch):
  # The engine's first step waits until the notice is logged (the notice's delay set to 0), so the test does not
  # depend on how long a step takes.
  noticed = threading.Event()

  class Recorder(logging.Handler):
    """Sets `noticed` when the compile notice is logged."""

    def emit(self, record):
      if record.getMessage() == engine_module.COMPILE_NOTICE:
        noticed.set()

  status_logger.addHandler(Recorder())
  status_logger.setLevel(logging.INFO)
  monkeypatch.setattr(engine_module, "COMPILE_NOTICE_S", 0.0)
  engine = engine_module.LLMEngine(load_config(model_name="llama-tiny", max_target_length=16))

  def waiting_step():
    assert noticed.wait(60)
    return []

  monkeypatch.setattr(engine, "_step", waiting_step)
  assert engine.step() == [] and noticed.is_set()
