"""The CPU reference runner imports nothing from the vLLM glue: the model's facts it needs (the cache contract in
`maxtext.kv_cache`, the runner's calling contract in `maxtext.causal_lm`) sit below both runners."""

import pathlib

import pytest
from support.imports import imported_modules

SRC = pathlib.Path(__file__).resolve().parents[3] / "src"


def offenders(modules: list[pathlib.Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
  """`{module file name: the forbidden modules it imports}` over `modules`."""
  found = {}
  for path in modules:
    bad = sorted(m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
    if bad:
      found[path.as_posix()] = bad
  return found


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("maxtext/inference", ("maxtext.integration",)),
        ("maxtext/kv_cache", ("maxtext.integration", "maxtext.inference", "maxtext.causal_lm")),
        ("maxtext/causal_lm.py", ("maxtext.integration", "maxtext.inference")),
    ],
)
def test_no_module_imports_a_higher_package(package, forbidden):
  root = SRC / package
  modules = sorted(root.rglob("*.py")) if root.is_dir() else [root]
  assert modules
  assert not offenders(modules, forbidden)


def test_the_walk_sees_imports_inside_functions(tmp_path):
  # A checker that found nothing would pass the test above; this one must find both imports, and not the third.
  module = tmp_path / "m.py"
  module.write_text(
      "from maxtext.integration.vllm import adapter\nimport maxtext.kv_cache\n\n"
      "def f():\n  import maxtext.integration.vllm.plugin\n"
  )
  assert offenders([module], ("maxtext.integration",)) == {
      module.as_posix(): [
          "maxtext.integration.vllm",
          "maxtext.integration.vllm.adapter",
          "maxtext.integration.vllm.plugin",
      ]
  }
