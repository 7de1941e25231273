"""Size of a traced or compiled JAX program: jaxpr equations and compiled HLO instructions.

Tests and benchmarks use these counts to show that a change (such as remapping KV-cache slots) adds no
operation to the program: two functions that differ only in Python-level bookkeeping trace to the same number
of equations and compile to the same number of HLO instructions.
"""

import re

import jax.extend.core as jex_core

# An instruction line inside a computation body: `  %add.3 = f32[3]{0} add(...)`, `  ROOT %t = (...) tuple(...)`.
# Newer XLA versions print names without the `%` sigil, so it is optional.
_HLO_INSTRUCTION_RE = re.compile(r"^\s+(ROOT\s+)?%?[\w.\-]+ = ")


def count_hlo_instructions(hlo_text: str) -> int:
  """Counts the instructions of every computation in HLO text.

  Only lines inside computation bodies count: a body starts at an unindented line ending in `{` (a computation
  header such as `ENTRY %main.4 (x.1: f32[3]) -> f32[3] {`) and ends at a line that is just `}`. Module headers
  and the metadata tables newer XLA versions print (`FileNames`, `StackFrames`, ...) are ignored.

  Args:
    hlo_text: HLO module text, e.g. `jax.jit(f).lower(*args).compile().as_text()`.

  Returns:
    The number of instruction lines, fused computations included.

  Raises:
    ValueError: the text contains no computation (not HLO text), or a computation is never closed.
  """
  count = 0
  num_computations = 0
  in_body = False
  for line in hlo_text.splitlines():
    if in_body:
      if line.strip() == "}":
        in_body = False
      elif _HLO_INSTRUCTION_RE.match(line):
        count += 1
    elif line and not line[0].isspace() and line.rstrip().endswith("{"):
      in_body = True
      num_computations += 1
  if in_body:
    raise ValueError("hlo_text must be complete HLO module text, but its last computation is never closed by '}'")
  if num_computations == 0:
    raise ValueError(f"hlo_text must contain at least one HLO computation, got {hlo_text[:80]!r}")
  return count


def count_jaxpr_equations(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> int:
  """Counts the equations of a jaxpr, including those of nested jaxprs (jit, cond and scan bodies, ...).

  Args:
    jaxpr: e.g. `jax.make_jaxpr(f)(*args)`.

  Returns:
    The total number of equations at every nesting level.

  Raises:
    TypeError: `jaxpr` is not a jaxpr.
  """
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  if not isinstance(jaxpr, jex_core.Jaxpr):
    raise TypeError(
        f"jaxpr must be a jax ClosedJaxpr or Jaxpr (e.g. jax.make_jaxpr(f)(*args)), got {type(jaxpr).__name__}"
    )
  count = 0
  for eqn in jaxpr.eqns:
    count += 1
    for value in eqn.params.values():
      # Sub-jaxprs sit in params directly (jit, scan) or in tuples of them (cond branches).
      for sub in value if isinstance(value, tuple) else (value,):
        if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
          count += count_jaxpr_equations(sub)
  return count
