"""The CLI under faults, in a subprocess: a reader that closes stdout early, Ctrl-C mid-decode, a folder that is
not a checkpoint. Each ends with a defined exit status and no traceback."""

import os
import pathlib
import re
import selectors
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A run long enough to be interrupted: 4000 tokens of the tiny hybrid model take minutes on a 2-core CPU. JSON
# output, so the progress bar (not streamed text) shows on stderr when tokens are being generated.
LONG_RUN = [
    "configs/base.yml",
    "model_name=qwen3-next-tiny",
    "max_target_length=4096",
    "max_new_tokens=4000",
    "num_kv_blocks=300",
    "output_format=json",
]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


def _start(args, **kwargs):
  return subprocess.Popen(  # pylint: disable=consider-using-with  # the tests drive the process by hand
      [sys.executable, "-m", "maxtext.decode", *args], cwd=ROOT, env=_env(), **kwargs
  )


def test_a_reader_that_closes_stdout_early_gets_no_traceback():
  proc = _start(["--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  proc.stdout.close()  # like `| head -0`: closed before the first write
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1, err
  assert b"Traceback" not in err and b"BrokenPipeError" not in err, err


def _wait_for(proc, pattern, timeout):
  """Reads stderr until the regular expression `pattern` matches; returns what was read."""
  selector = selectors.DefaultSelector()
  selector.register(proc.stderr, selectors.EVENT_READ)
  seen = b""
  deadline = time.monotonic() + timeout
  while not re.search(pattern, seen):
    remaining = deadline - time.monotonic()
    assert remaining > 0 and proc.poll() is None, seen
    if selector.select(remaining):
      seen += os.read(proc.stderr.fileno(), 4096)
  return seen


def test_ctrl_c_mid_decode_exits_130_without_a_traceback():
  proc = _start(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    # The progress bar has counted generated tokens (its first render, "0/4000", comes before the first step).
    before = _wait_for(proc, rb"[1-9][0-9]*/4000", timeout=300)
    proc.send_signal(signal.SIGINT)
    out, after = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  err = (before + after).decode("utf-8", "replace")
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  assert err.rstrip().splitlines()[-1] == "maxtext-decode: interrupted"
  assert out == b""


def test_load_parameters_path_that_is_not_a_checkpoint_is_one_line(tmp_path):
  (tmp_path / "README").write_text("not a checkpoint", encoding="utf-8")
  proc = _start(
      ["configs/base.yml", "model_name=llama-tiny", f"load_parameters_path={tmp_path}"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 2, err
  assert out == ""
  assert err.splitlines() == [
      f"maxtext-decode: error: '{tmp_path}' is not an Orbax parameter checkpoint (it has no _METADATA file)"
  ]
