"""What the `scripts/benchmark_*.py` command lines share: positive integer options, the `--quick` and `--json`
flags, printing one JSON object or a header and a table, and matplotlib for `--plot`."""

import argparse
import json
from collections.abc import Iterable
from typing import Any


def positive_int(text: str) -> int:
  """An argparse type: an integer of at least 1 (argparse reports anything else as a usage error)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def add_output_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
  """Adds `--quick` (a smoke-sized run, described by `quick_help`) and `--json`."""
  parser.add_argument("--quick", action="store_true", help=quick_help)
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def emit(as_json: bool, payload: dict[str, Any], lines: Iterable[str]) -> None:
  """Prints `payload` as one JSON object when `as_json`, else each of `lines` (a header, then the table)."""
  if as_json:
    print(json.dumps(payload))
  else:
    for line in lines:
      print(line)


def pyplot(path: str) -> tuple[Any, str]:
  """(matplotlib's pyplot on the file-only Agg backend, ""), or (None, the message a `--plot PATH` run reports) when
  matplotlib is not installed: it is optional, only plots need it."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel  # optional: only the --plot step needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel  # optional, see above
  except ImportError:
    return None, f"--plot skipped: matplotlib is not installed (pip install matplotlib to write {path})"
  return plt, ""
