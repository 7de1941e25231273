"""Reading a module's imports from its source, for the tests that keep the packages' import directions."""

import ast
import pathlib


def imported_modules(path: pathlib.Path) -> set[str]:
  """Every module `path` names in an import statement, at any depth (inside functions and branches too), with
  `from m import x` counted as both `m` and `m.x`."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names
