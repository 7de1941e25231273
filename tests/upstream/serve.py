"""A `vllm serve` process for the upstream tier (serve_test.py): the command and the client example of
docs/serving.md, the server started in a process group of its own and stopped with everything it started, and the
request timings the tier prints at its end (conftest.py's `pytest_terminal_summary`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
SERVING_MD = HERE.parents[1] / "docs" / "serving.md"
# Its sitecustomize.py installs the stand-ins in every process of the server (the engine core is a child process).
SITE = HERE / "serve_site"
# What docs/serving.md's client example connects to; the test gives it the server's address instead.
DOC_BASE_URL = "http://localhost:8000/v1"
STANDS_IN = re.compile(r"stand-ins installed in process (\d+)")

# (kind, seconds, completion tokens, HTTP requests) of every call, in order; printed after the run.
TIMINGS: list[tuple[str, float, int, int]] = []
# Other durations the summary shows first (startup, wall time of the concurrent requests, first streamed chunks).
DURATIONS: dict[str, float] = {}


def record(kind: str, seconds: float, tokens: int, requests: int = 1) -> None:
  """Adds one call's time, completion tokens and HTTP requests to the summary."""
  TIMINGS.append((kind, seconds, tokens, requests))


def summary() -> list[str]:
  """The timing lines the tier prints: the durations, then per kind of call its count, tokens, mean, max and total
  seconds, then the HTTP requests in all."""
  if not TIMINGS:
    return []
  lines = [f"vllm serve: {name}: {seconds:.3f} s" for name, seconds in DURATIONS.items()]
  kinds: dict[str, list[tuple[float, int, int]]] = collections.defaultdict(list)
  for kind, seconds, tokens, requests in TIMINGS:
    kinds[kind].append((seconds, tokens, requests))
  for kind, rows in kinds.items():
    times = [s for s, _, _ in rows]
    tokens = sum(t for _, t, _ in rows)
    lines.append(
        f"vllm serve: {kind}: {len(rows)} call(s){f', {tokens} tokens' if tokens else ''}, mean"
        f" {sum(times) / len(times):.3f} s, max {max(times):.3f} s, total {sum(times):.3f} s"
    )
  requests, total = sum(r for *_, r in TIMINGS), sum(s for _, s, _, _ in TIMINGS)
  lines.append(f"vllm serve: {requests} HTTP requests in all, {total:.2f} s of request time")
  return lines


def fenced_blocks(language: str, text: str | None = None) -> list[str]:
  """The bodies of docs/serving.md's fenced blocks of `language`."""
  text = SERVING_MD.read_text(encoding="utf-8") if text is None else text
  return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def doc_block(language: str, first_line: str) -> str:
  """The one fenced block of docs/serving.md whose first line starts with `first_line`."""
  blocks = [b for b in fenced_blocks(language) if b.startswith(first_line)]
  assert len(blocks) == 1, f"docs/serving.md needs one {language} block starting with {first_line!r}, has {len(blocks)}"
  return blocks[0]


def doc_command(model: str, port: int) -> list[str]:
  """docs/serving.md's CPU `vllm serve` command as argv, `$MODEL` and `$PORT` filled in, `vllm` this venv's."""
  argv = shlex.split(doc_block("bash", 'vllm serve "$MODEL"').replace("\\\n", " "))
  fill = {"$MODEL": model, "$PORT": str(port), "vllm": str(pathlib.Path(sys.executable).parent / "vllm")}
  return [fill.get(arg, arg) for arg in argv]


def free_port() -> int:
  """A loopback port nothing listens on now."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@dataclasses.dataclass
class Server:
  """A running `vllm serve`: its process (leader of its own process group), address and log file."""

  process: subprocess.Popen
  base_url: str
  log_path: pathlib.Path

  def log(self) -> str:
    """Everything the server and its children wrote so far."""
    return self.log_path.read_text(encoding="utf-8", errors="replace")

  def wait_healthy(self, timeout_s: float) -> None:
    """Returns once `/health` answers 200; fails with the log's tail if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    health = self.base_url.removesuffix("/v1") + "/health"
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise AssertionError(f"vllm serve exited ({self.process.returncode}):\n{self.tail()}")
      try:
        with urllib.request.urlopen(health, timeout=5) as response:
          if response.status == 200:
            return
      except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
      time.sleep(1)
    raise AssertionError(f"vllm serve not healthy after {timeout_s:.0f} s:\n{self.tail()}")

  def tail(self, lines: int = 30) -> str:
    """The log's last lines, for failure messages."""
    return "\n".join(self.log().splitlines()[-lines:])

  def stop(self, grace_s: float = 30) -> int:
    """SIGTERM to the API server, which shuts its engine core down (a SIGTERM to the engine core too would end it
    under the API server, which then logs the dead engine's traceback); SIGKILL to whatever of the process group is
    left after `grace_s`. Returns the server's exit code once no process of the group remains. Idempotent."""
    pgid = self.process.pid  # the leader of a new session: its pid is the group id
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(grace_s)
      except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
      time.sleep(0.2)
    if group_alive(pgid):
      os.killpg(pgid, signal.SIGKILL)
    self.process.wait(grace_s)
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:
      time.sleep(0.1)
    return self.process.returncode


def group_alive(pgid: int) -> bool:
  """Whether any process of the group is still there (zombies included until reaped)."""
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  return True


def start(argv: list[str], env: dict[str, str], log_path: pathlib.Path, port: int) -> Server:
  """Starts `argv` in a new session (so that stopping the group reaches the engine core and its helpers), its
  output to `log_path`."""
  with log_path.open("w", encoding="utf-8") as log:
    process = subprocess.Popen(  # pylint: disable=consider-using-with  # Server.stop ends it
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
  return Server(process, f"http://127.0.0.1:{port}/v1", log_path)
