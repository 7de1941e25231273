"""The runner's functions stay short enough to read whole: none in `maxtext.inference` is over 60 lines."""

import ast
import pathlib

import pytest

from maxtext import inference

MAX_LINES = 60
PACKAGE = pathlib.Path(inference.__file__).parent


def long_functions(folder: pathlib.Path, max_lines: int) -> list[str]:
  """`path:line name (n lines)` of every function or method in `folder`'s modules longer than `max_lines`, counted
  from its `def` line to the last line of its body (docstring included)."""
  found = []
  for path in sorted(folder.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > max_lines:
          found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
  return found


def test_no_function_of_the_runner_is_over_60_lines():
  assert not long_functions(PACKAGE, MAX_LINES), f"split these along their seams: {long_functions(PACKAGE, MAX_LINES)}"


@pytest.mark.parametrize("body_lines, expected", [(58, []), (59, ["m.py:1 f (61 lines)"])])
def test_the_count_runs_from_the_def_line_to_the_last_body_line(tmp_path, body_lines, expected):
  # def line + docstring line + body_lines statements.
  (tmp_path / "m.py").write_text('def f():\n  """Doc."""\n' + "  x = 1\n" * body_lines)
  assert long_functions(tmp_path, MAX_LINES) == expected
