r"""`maxtext-decode` / `python -m maxtext.decode`: run a decode from a YAML config and `key=value` overrides.

    maxtext-decode configs/base.yml model_name=qwen3-next-tiny prompt="I love to" max_new_tokens=16
    maxtext-decode configs/base.yml model_name=qwen3-next-tiny output_format=json max_new_tokens=8
    maxtext-decode configs/base.yml model_name=qwen3.5-tiny dry_run=true      # the cache layout, no model run
    maxtext-decode configs/base.yml model_name=smollm2-135m-instruct prompt="What is the capital of France?" \
        use_chat_template=true                                                # a real model (fetch it first)
    maxtext-decode configs/base.yml model_name=llama-tiny prompts_file=prompts.jsonl output_format=json max_new_tokens=8

Text output streams the completion of a single prompt to stdout as it is generated; with `prompts_file=` (one
prompt per line, or JSON Lines with "prompt" or "prompt_token_ids") all prompts are decoded together and each
completion is printed after a `=== prompt K (line N) ===` header, in file order, as soon as it and every earlier
one are finished. `output_format=json` prints exactly one JSON object on stdout, at the end:
`{"requests": [{"prompt_token_ids", "output_token_ids", "text", "finish_reason", "logprobs"}], "stats": {...}}`
(finish_reason: "stop" at eos or a stop token, "length" at max_new_tokens or max_target_length). Without
max_new_tokens (or with 0) a completion runs until eos, within max_target_length; text output gets one stderr
warning when a completion stopped at a length limit instead. Logs and progress go to stderr; on a terminal, stderr
also shows what the start is doing (importing, loading the weights, compiling) from its first moment. Bad input (unknown
key, bad value, missing file) prints one line on stderr and exits with status 2; Ctrl-C exits with status 130.
"""

from __future__ import annotations

# Only the standard library here: `main` sets up Ctrl-C handling before it imports the CLI's work (JAX, Flax, the
# models: seconds, in `run`), so an interrupt during those imports ends the CLI like one during decoding.
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

USAGE = "usage: maxtext-decode [configs/base.yml] key=value ...  (see configs/base.yml for every key)"
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 1  # the reader of stdout went away (`maxtext-decode --help | head -1`)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
INTERRUPTED = "maxtext-decode: interrupted"
# On a terminal, the program's first line, written before the seconds of imports; then the engine's status lines
# (the `maxtext.status` logger: loading the weights, compiling), so the wait before the first token is never silent.
STARTING = "maxtext-decode: starting (importing JAX and the model code)"
STATUS_LOGGER = "maxtext.status"


def run(argv: Sequence[str], cancel: threading.Event | None = None) -> int:
  """Runs the CLI on `argv` (without the program name); returns the exit status. Setting `cancel` stops the
  generation before its next step (KeyboardInterrupt, its requests aborted). See `maxtext.decode_run.run`."""
  from maxtext import decode_run  # pylint: disable=import-outside-toplevel  # seconds of imports: after the handler

  return decode_run.run(argv, cancel)


def show_status(stream: Any) -> None:
  """Writes the `STARTING` line to `stream` and from now on every `maxtext.status` record as one line
  `maxtext-decode: <message>` there (the records do not reach the root logger's warning-level handler)."""
  stream.write(STARTING + "\n")
  stream.flush()
  handler = logging.StreamHandler(stream)
  handler.setFormatter(logging.Formatter("maxtext-decode: %(message)s"))
  status = logging.getLogger(STATUS_LOGGER)
  status.addHandler(handler)
  status.setLevel(logging.INFO)
  status.propagate = False


def _user_errors() -> tuple[type[BaseException], ...]:
  """The exceptions that mean "the input is wrong" (`decode_run.USER_ERRORS`), once that module is imported."""
  module = sys.modules.get("maxtext.decode_run")
  return module.USER_ERRORS if module is not None else ()


def _print_usage() -> int:
  print(USAGE)
  print(__doc__)
  return 0


def _silence_stdout() -> None:
  """Points stdout at /dev/null, so the interpreter's final flush cannot raise BrokenPipeError again."""
  try:
    fileno = sys.stdout.fileno()
  except (OSError, ValueError, AttributeError):  # a replaced stdout (e.g. captured) has no descriptor to redirect
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, fileno)
  os.close(devnull)


def _in_gc_callback(frame: types.FrameType | None) -> bool:
  """Whether `frame` runs inside one of the garbage collector's callbacks (`gc.callbacks`)."""
  codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
  while frame is not None:
    if frame.f_code in codes:
      return True
    frame = frame.f_back
  return False


def _open_progress_bars() -> list[Any]:
  """The tqdm progress bars that are drawn and not closed (tqdm keeps them in a class-level set); none while tqdm is
  not imported, or is being imported (an interrupt can land inside its import, before the class exists)."""
  tqdm_class = getattr(sys.modules.get("tqdm"), "tqdm", None)
  return [p for p in list(getattr(tqdm_class, "_instances", ())) if not getattr(p, "disable", True)]


def _end_progress_bars() -> None:
  """Closes the progress bars an interrupt left open, which ends their line on stderr. A loader's bar lives in a
  generator that is only closed once the interrupt's traceback is dropped, after the CLI's message."""
  for progress in _open_progress_bars():
    try:
      progress.close()
    except (OSError, ValueError):  # a stream closed under it: there is no line to end
      pass


def _is_terminal(stream: Any) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, OSError, ValueError):
    return False


def _exit_interrupted(signum: int, frame: types.FrameType | None) -> None:
  """The program's SIGINT handler: the interrupted line on stderr, then the process ends with status 130 at once.

  Nothing the program does needs undoing, and raising KeyboardInterrupt is not safe everywhere: inside an extension
  module's initialisation (an import) it is printed as a traceback by NumPy's import_array or crashes the process
  (SIGSEGV, seen while jaxlib's loaded), inside a gc callback it is printed and swallowed, and the interpreter's
  shutdown would wait for a thread compiling with XLA. The line starts a line of its own: after a progress bar, and
  on a terminal, where the echoed ^C or streamed text ends the current line without a newline.
  """
  del signum, frame
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, RuntimeError, ValueError):  # a closed pipe, or the signal came inside a write to the stream
      pass
  newline = bool(_open_progress_bars()) or (_is_terminal(sys.stderr) and _is_terminal(sys.stdout))
  os.write(2, (("\n" if newline else "") + INTERRUPTED + "\n").encode("utf-8"))
  os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access  # exits without unwinding or joining threads


@contextlib.contextmanager
def _cancel_on_sigint() -> Iterator[threading.Event]:
  """Within the block, Ctrl-C sets the yielded event as well as raising KeyboardInterrupt. Native code (XLA) that
  is running when the signal lands can swallow the KeyboardInterrupt; the event still stops generation before its
  next step. The previous handler is restored afterwards."""
  cancel = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield cancel  # signal handlers can only be set from the main thread
    return

  def on_sigint(signum, frame):
    cancel.set()
    # Raised inside a gc callback (JAX registers one), KeyboardInterrupt would be printed as "Exception ignored"
    # with a traceback and swallowed; the event alone stops the generation there.
    if not _in_gc_callback(frame):
      signal.default_int_handler(signum, frame)

  previous = signal.signal(signal.SIGINT, on_sigint)
  try:
    yield cancel
  finally:
    signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
  """Console entry point: user errors become one line on stderr and exit status 2 (no argument at all: the usage
  line); Ctrl-C exits 130 with one line.

  Without `argv`, main is the program (`sys.argv`): its first act is a SIGINT handler that ends the process at once
  (`_exit_interrupted`), before the seconds of imports, and left in place for the interpreter's shutdown; when
  stderr is a terminal, its next is the `STARTING` line and the engine's status lines (`show_status`). With
  `argv` (called in-process), Ctrl-C raises KeyboardInterrupt, which aborts the run's requests and returns 130.
  """
  program = argv is None
  if program and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, _exit_interrupted)
  args = sys.argv[1:] if program else list(argv)
  if not args:
    # Without any argument the run would decode the base config's random-weight model: almost surely not meant.
    print(USAGE, file=sys.stderr)
    return EXIT_USAGE
  if program and args[0] not in ("-h", "--help") and _is_terminal(sys.stderr):
    show_status(sys.stderr)  # only on a terminal: a pipe or a file gets exactly the lines it got before
  with contextlib.nullcontext(threading.Event()) if program else _cancel_on_sigint() as cancel:
    try:
      logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
      status = _print_usage() if args[0] in ("-h", "--help") else run(args, cancel)
      sys.stdout.flush()  # a closed pipe raises here, inside the handler, rather than at interpreter exit
      return status
    except BaseException as e:  # pylint: disable=broad-exception-caught  # each kind is sorted out below
      # Ctrl-C raises KeyboardInterrupt, which a library may turn into its own error (NumPy, interrupted while it
      # imports, raises ImportError); the event says the user asked to stop either way.
      if isinstance(e, KeyboardInterrupt) or cancel.is_set():
        _end_progress_bars()
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
      if isinstance(e, BrokenPipeError):
        _silence_stdout()
        return EXIT_BROKEN_PIPE
      if not isinstance(e, _user_errors()):
        raise
      message = " ".join(str(e).split()) or type(e).__name__
      print(f"maxtext-decode: error: {message}", file=sys.stderr)
      return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
