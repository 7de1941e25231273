"""Benchmark: how soon the first token shows, warm, for the CLI and the `LLM` API, beside llama.cpp.

The README's command

    maxtext-decode configs/base.yml model_name=smollm2-135m-instruct prompt="What is the capital of France?" \
        use_chat_template=true

runs once to fill the caches (the compilation cache and the weight cache), then `--repeats` more times, each a
fresh process (`python -m maxtext.decode`, stdout a pipe, stderr a terminal as a user's is), timed from the spawn to
the first byte on stderr (`first_err_s`: something on the screen) and on stdout (`ttft_s`: the first token of the
completion). Each of those processes is killed once its first token is out. The API worker times
`LLM(config_path, model_name=..., use_chat_template=True)` from construction to the first token of the same prompt
(`api_ttft_s`, the imports not counted) and the process from its spawn to that token (`ttft_s`). The llama.cpp peer
(llama-cpp-python in its own venv, built by scripts/setup_llama_cpp_env.sh; `--llama-python`) loads the same GGUF
file with 2 threads and evaluates the same prompt ids (the chat template as this package renders it) to the first
greedy token: `api_ttft_s` from `Llama(...)` to that token, `ttft_s` from its process's spawn. When that interpreter
is missing or cannot import llama_cpp, the peer is skipped with a one-line note. Every figure is the best of the
runs. `--cold` adds one run of each maxtext path over empty cache folders of its own (a first run after install).

`--model gemma3-270m` runs another GGUF model of scripts/benchmark_decode_peers.py's table instead, its README
prompt made as that table says (Gemma 3 270M: raw text after BOS, no chat template) and `max_new_tokens=1`: then
the CLI's runs are not killed but timed to their exit too (`exit_s`), a one-token answer's whole process.
`--variant` adds a `--maxtext-variants` entry's config keys (e.g. `compact`: weight_dtype=bfloat16
greedy_head_candidates=64) to the CLI's and the API's.

Timings are measurements only; on a shared machine compare ratios from one run, not absolute numbers.

`--src DIR` measures another source tree (a checkout's src/, e.g. the baseline of a change) with this driver.

Usage: python scripts/benchmark_startup.py [--model smollm2|gemma3-270m] [--variant NAME|key=value] [--repeats 3]
                                           [--llama-python PATH] [--cold] [--src DIR] [--quick] [--json]
"""

import argparse
import importlib.util
import json
import os
import pty
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support/, imported as `support`
# pylint: disable=wrong-import-position  # the imports below need the line above

from support import benchmark_cli

ROOT = Path(__file__).resolve().parents[1]
RESULT_MARK = "BENCHMARK_RESULT "
FIRST_TOKEN_MARK = "FIRST_TOKEN\n"
PROMPT = "What is the capital of France?"


def _load_peers() -> Any:
  """scripts/benchmark_decode_peers.py: the GGUF models' table and the `--maxtext-variants` names."""
  spec = importlib.util.spec_from_file_location("benchmark_decode_peers", ROOT / "scripts" / "benchmark_decode_peers.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


peers_module = _load_peers()


def model_args(model: str, variant: str = "float32") -> list[str]:
  """The CLI's `key=value` arguments for the GGUF `model` (a key of peers_module.GGUF_MODELS) and `variant`: the
  README command for smollm2; for another model its README prompt, a one-token answer.

  Raises:
    ValueError: `variant` is neither a `--maxtext-variants` name nor `key=value`.
  """
  spec = peers_module.GGUF_MODELS[model]
  args = [f"model_name={spec.model_name}", f"prompt={spec.prompt}"]
  args += ["use_chat_template=true"] if spec.use_chat_template else []
  args += [] if model == "smollm2" else ["max_new_tokens=1"]
  return args + list(peers_module.variant_overrides(variant))


def _prompt_of(args: Sequence[str]) -> str:
  return next(item.partition("=")[2] for item in args if item.startswith("prompt="))


# --quick: a random-weight tiny model (no file to fetch), the same paths.
QUICK_ARGS = ["model_name=llama-tiny", f"prompt={PROMPT}", "max_new_tokens=4"]
LLAMA_VENV = Path(
    os.environ.get("MAXTEXT_LLAMA_CPP_VENV") or Path.home() / ".cache" / "maxtext" / "llama-cpp-python-0.3.36"
)
DEFAULT_LLAMA_PYTHON = str(LLAMA_VENV / "bin" / "python")
LLAMA_THREADS = 2


# ----------------------------------------------------------------------------------------------- worker processes


def _api_worker(args: Sequence[str]) -> dict[str, Any]:
  """Times `LLM(...)` construction to the first token of the CLI `args`' prompt; writes FIRST_TOKEN_MARK to stdout
  at that token."""
  # pylint: disable=import-outside-toplevel  # imported apart from the timed span
  import maxtext
  from maxtext.inference import LLM, SamplingParams

  prompt = _prompt_of(args)
  llm_args = [item for item in args if not item.startswith(("prompt=", "max_new_tokens="))]
  first: list[float] = []

  def on_token(index: int, token: int) -> None:
    del index, token
    if not first:
      first.append(time.perf_counter())
      sys.stdout.write(FIRST_TOKEN_MARK)
      sys.stdout.flush()

  start = time.perf_counter()
  llm = LLM(str(Path(maxtext.__file__).parent / "configs" / "base.yml"), argv=llm_args)  # the measured tree's
  llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False, on_token=on_token)
  return {
      "api_ttft_s": first[0] - start,
      "prompt_token_ids": llm.prompt_token_ids(prompt),
      "weights_from_cache": getattr(llm.engine, "weights_from_cache", None),  # None: a tree without the cache
  }


def _llama_worker(model_path: str, prompt_ids: Sequence[int]) -> dict[str, Any]:
  """llama.cpp: `Llama(...)` construction to the first greedy token of `prompt_ids`."""
  import llama_cpp  # pylint: disable=import-outside-toplevel,import-error  # only in the llama.cpp venv

  start = time.perf_counter()
  llm = llama_cpp.Llama(model_path=model_path, n_threads=LLAMA_THREADS, n_ctx=512, verbose=False)
  token = next(llm.generate(list(prompt_ids), temp=0.0))
  elapsed = time.perf_counter() - start
  sys.stdout.write(FIRST_TOKEN_MARK)
  sys.stdout.flush()
  return {"api_ttft_s": elapsed, "first_token": int(token), "version": llama_cpp.__version__}


def _worker_main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="benchmark_startup worker")
  parser.add_argument("role", choices=("api", "llama"))
  parser.add_argument("--args", default="[]")  # the CLI's key=value arguments, as JSON
  parser.add_argument("--model-path", default="")
  parser.add_argument("--prompt-ids", default="[]")
  args = parser.parse_args(argv)
  if args.role == "api":
    result = _api_worker(json.loads(args.args))
  else:
    result = _llama_worker(args.model_path, json.loads(args.prompt_ids))
  print(RESULT_MARK + json.dumps(result), flush=True)
  return 0


# ----------------------------------------------------------------------------------------------- the driver


SRC = [str(ROOT / "src")]  # the source tree measured (`--src`)


def _env(cache_root: str | None = None) -> dict[str, str]:
  """This environment with the measured src/ first on PYTHONPATH; with `cache_root`, the weight cache and the
  compilation cache in empty folders there (a cold start)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(SRC + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  if cache_root is not None:
    env["MAXTEXT_WEIGHT_CACHE_DIR"] = os.path.join(cache_root, "weights")
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache_root, "jax")
  return env


def time_process(cmd: Sequence[str], env: dict[str, str], timeout: float, *, kill_at_first_token: bool) -> dict[str, Any]:
  """Spawns `cmd` with stdout a pipe and stderr a terminal; returns the seconds from the spawn to the first byte on
  each (`first_err_s`, `ttft_s`: for the workers, their FIRST_TOKEN_MARK), to its exit (`exit_s`; None when
  killed at the first token), the whole stdout and stderr, and the exit status (None when killed).

  Raises:
    TimeoutError: no first token within `timeout` seconds.
  """
  leader, follower = pty.openpty()
  start = time.perf_counter()
  # pylint: disable-next=consider-using-with  # read by select until the first token, then killed or waited for
  proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=follower, env=env, cwd=ROOT)
  os.close(follower)
  out, err, first_err, first_out = b"", b"", None, None
  open_fds = {proc.stdout.fileno(): "out", leader: "err"}
  try:
    while open_fds:
      remaining = timeout - (time.perf_counter() - start)
      if remaining <= 0:
        raise TimeoutError(f"{cmd[2:4]}: no first token within {timeout:.0f} s; stderr: {err[-300:]!r}")
      ready, _, _ = select.select(list(open_fds), [], [], remaining)
      for fd in ready:
        try:
          chunk = os.read(fd, 65536)
        except OSError:  # the terminal's other end closed
          chunk = b""
        if not chunk:
          del open_fds[fd]
          continue
        now = time.perf_counter() - start
        if open_fds[fd] == "out":
          first_out = now if first_out is None else first_out
          out += chunk
        else:
          first_err = now if first_err is None else first_err
          err += chunk
      if first_out is not None and kill_at_first_token:
        proc.send_signal(signal.SIGKILL)
        break
  finally:
    if proc.poll() is None and (kill_at_first_token or open_fds):
      proc.kill()
    status = proc.wait()
    exit_s = None if kill_at_first_token else time.perf_counter() - start
    os.close(leader)
  return {
      "exit_s": exit_s,
      "first_err_s": first_err,
      "ttft_s": first_out,
      "stdout": out.decode("utf-8", "replace"),
      "stderr": err.decode("utf-8", "replace"),
      "status": None if kill_at_first_token else status,
  }


def _base_yml() -> str:
  """The measured tree's base.yml (the repository's configs/base.yml links to it)."""
  return os.path.join(SRC[0], "maxtext", "configs", "base.yml")


def _worker_cmd(python: str, role: str, *args: str) -> list[str]:
  return [python, str(Path(__file__).resolve()), "--_worker", role, *args]


def _result(run: dict[str, Any]) -> dict[str, Any]:
  lines = [line for line in run["stdout"].splitlines() if line.startswith(RESULT_MARK)]
  if run["status"] != 0 or not lines:
    tail = (run["stderr"].strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"worker failed (exit status {run['status']}): {tail}")
  return json.loads(lines[-1][len(RESULT_MARK) :])


def llama_available(python: str) -> tuple[bool, str]:
  """Whether `python` exists and imports llama_cpp, and why not."""
  if not os.path.exists(python):
    return False, f"{python} does not exist (build it with scripts/setup_llama_cpp_env.sh)"
  proc = subprocess.run(
      [python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=300, check=False, env=_env()
  )
  if proc.returncode != 0:
    return False, f"{python} cannot import llama_cpp: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
  return True, ""


def _best(runs: Sequence[dict[str, Any]], field: str) -> float | None:
  values = [r[field] for r in runs if r.get(field) is not None]
  return min(values) if values else None


def measure(
    repeats: int, quick: bool, llama_python: str, cold: bool, timeout: float, model: str = "smollm2", variant: str = ""
) -> dict[str, Any]:
  """Every peer's runs of the GGUF `model` with `variant`'s keys; returns the report (rows of best-of-`repeats`
  figures, and notes)."""
  args = [_base_yml(), *(QUICK_ARGS if quick else model_args(model, variant or "float32"))]
  cli = [sys.executable, "-m", "maxtext.decode", *args]
  api = _worker_cmd(sys.executable, "api", "--args", json.dumps(args[1:]))
  one_token = "max_new_tokens=1" in args  # the CLI's whole run is its first token: timed to the exit too
  rows, notes = [], []
  if cold:
    with tempfile.TemporaryDirectory(prefix="maxtext-cold-") as root:
      env = _env(root)
      cli_run = time_process(cli, env, timeout, kill_at_first_token=True)
      rows.append({"peer": "maxtext-decode (cold)", **{k: cli_run[k] for k in ("first_err_s", "ttft_s")}})
    with tempfile.TemporaryDirectory(prefix="maxtext-cold-") as root:
      api_run = time_process(api, _env(root), timeout, kill_at_first_token=False)
      rows.append({"peer": "LLM API (cold)", "ttft_s": api_run["ttft_s"], **_result(api_run)})
  env = _env()
  time_process(cli, env, timeout, kill_at_first_token=False)  # fills the caches
  cli_runs = [time_process(cli, env, timeout, kill_at_first_token=not one_token) for _ in range(repeats)]
  rows.append({"peer": "maxtext-decode", **{k: _best(cli_runs, k) for k in ("first_err_s", "ttft_s", "exit_s")}})
  api_runs = [time_process(api, env, timeout, kill_at_first_token=False) for _ in range(repeats)]
  results = [_result(run) for run in api_runs]
  rows.append(
      {
          "peer": "LLM API",
          "ttft_s": _best(api_runs, "ttft_s"),
          "api_ttft_s": _best(results, "api_ttft_s"),
          "weights_from_cache": [r["weights_from_cache"] for r in results],
      }
  )
  prompt_ids = results[0]["prompt_token_ids"]
  available, why = llama_available(llama_python)
  if quick:
    notes.append("llama.cpp skipped: --quick runs a random-weight model that has no GGUF file")
  elif not available:
    notes.append(f"llama.cpp skipped: {why}")
  else:
    model_path = peers_module.fetch_gguf(model)
    llama = _worker_cmd(llama_python, "llama", "--model-path", model_path, "--prompt-ids", json.dumps(prompt_ids))
    llama_runs = [time_process(llama, env, timeout, kill_at_first_token=False) for _ in range(repeats)]
    llama_results = [_result(run) for run in llama_runs]
    rows.append(
        {
            "peer": f"llama.cpp {llama_results[0]['version']} ({LLAMA_THREADS} threads)",
            "ttft_s": _best(llama_runs, "ttft_s"),
            "api_ttft_s": _best(llama_results, "api_ttft_s"),
        }
    )
  for row in rows:
    row.pop("prompt_token_ids", None)
  return {
      "settings": {"repeats": repeats, "quick": quick, "command": args, "cold": cold, "src": SRC[0], "model": model},
      "results": rows,
      "notes": notes,
  }


def _cell(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}"


def format_table(report: dict[str, Any]) -> list[str]:
  """The header line and one line per peer, then the notes."""
  lines = [
      f"{'peer':<32} {'first_err_s':>11} {'ttft_s':>8} {'exit_s':>8} {'api_ttft_s':>10}",
  ]
  for row in report["results"]:
    lines.append(
        f"{row['peer']:<32} {_cell(row.get('first_err_s')):>11} {_cell(row.get('ttft_s')):>8}"
        f" {_cell(row.get('exit_s')):>8} {_cell(row.get('api_ttft_s')):>10}"
    )
  return lines + [f"note: {note}" for note in report["notes"]]


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--_worker"]:
    return _worker_main(argv[1:])
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--model", choices=tuple(peers_module.GGUF_MODELS), default="smollm2", help="the GGUF model")
  parser.add_argument("--variant", default="", help="a --maxtext-variants name of benchmark_decode or key=value")
  parser.add_argument("--repeats", type=benchmark_cli.positive_int, default=None, help="timed runs per peer (3)")
  parser.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON, help="interpreter of the llama.cpp venv")
  parser.add_argument("--cold", action="store_true", help="also one run over empty cache folders")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
  parser.add_argument("--src", default=SRC[0], help="the source tree to measure (a checkout's src/, e.g. a baseline)")
  benchmark_cli.add_output_flags(parser, "a random-weight tiny model, one run each (a smoke test)")
  args = parser.parse_args(argv)
  try:
    peers_module.variant_overrides(args.variant or "float32")
  except ValueError as e:
    parser.error(f"--variant: {e}")
  repeats = args.repeats or (1 if args.quick else 3)
  SRC[:] = [os.path.abspath(args.src)]
  report = measure(repeats, args.quick, args.llama_python, args.cold, args.timeout, args.model, args.variant)
  header = (
      f"{args.model}{' ' + args.variant if args.variant else ''}: warm start, best of {repeats} (seconds from the "
      "spawn; api_ttft_s from the constructor)"
  )
  benchmark_cli.emit(args.json, report, [header, *format_table(report)])
  return 0


if __name__ == "__main__":
  sys.exit(main())
