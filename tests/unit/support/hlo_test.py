"""Tests for support.hlo: HLO instruction and jaxpr equation counting."""

import jax
import jax.numpy as jnp
import pytest

from support import hlo

# Hand-written in the layout XLA prints for compiled modules: 3 + 4 instructions, plus a module header, the
# metadata tables (which contain `=` and braces but are not instructions) and a blank line inside a body.
_HLO_WITH_SIGILS = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[3]{0})->f32[3]{0}}

FileNames
1 "<string>"

FileLocations
1 {file_name_id=1 function_name_id=1 line=6 end_line=6 column=24 end_column=27}

%fused_computation (param_0: f32[3]) -> f32[3] {
  %param_0 = f32[3]{0} parameter(0)
  %constant.5 = f32[] constant(-1)
  ROOT %add.2 = f32[3]{0} add(%param_0, %constant.5), metadata={op_name="jit(f)/sub" stack_frame_id=4}
}

ENTRY %main.4 (x.1: f32[3]) -> f32[3] {
  %x.1 = f32[3]{0} parameter(0), metadata={op_name="x"}

  %add_fusion = f32[3]{0} fusion(%x.1), kind=kLoop, calls=%fused_computation
  %tuple.2 = (f32[3]{0}) tuple(%add_fusion)
  ROOT %get-tuple-element.2 = f32[3]{0} get-tuple-element(%tuple.2), index=0
}
"""

# The same two computations as newer XLA prints them (no `%` sigil).
_HLO_WITHOUT_SIGILS = _HLO_WITH_SIGILS.replace("%", "")


@pytest.mark.parametrize("text", [_HLO_WITH_SIGILS, _HLO_WITHOUT_SIGILS], ids=["sigils", "no_sigils"])
def test_count_hlo_instructions_counts_every_computation_body(text):
  assert hlo.count_hlo_instructions(text) == 7


def test_count_hlo_instructions_grows_with_the_program():
  small = jax.jit(jnp.sin).lower(jnp.ones(3)).compile().as_text()
  large = jax.jit(lambda x: (jnp.sin(x), jnp.argsort(x), jnp.cumsum(x))).lower(jnp.ones(3)).compile().as_text()
  assert hlo.count_hlo_instructions(large) > hlo.count_hlo_instructions(small)


def test_count_hlo_instructions_rejects_text_without_computations():
  with pytest.raises(ValueError, match=r"hlo_text must contain at least one HLO computation, got 'not hlo'"):
    hlo.count_hlo_instructions("not hlo")


def test_count_hlo_instructions_rejects_an_unclosed_computation():
  truncated = _HLO_WITH_SIGILS[: _HLO_WITH_SIGILS.rindex("}")]
  with pytest.raises(ValueError, match=r"its last computation is never closed by '\}'"):
    hlo.count_hlo_instructions(truncated)


def test_count_jaxpr_equations_flat():
  # sin, mul: two equations.
  assert hlo.count_jaxpr_equations(jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))) == 2


def test_count_jaxpr_equations_descends_into_nested_jaxprs():
  def f(x):
    y = jax.jit(lambda a: a * 2.0)(x)  # 1 jit equation + 1 inside
    # slice, squeeze, gt, convert_element_type, cond: 5 equations + 1 in each of the 2 branches.
    return jax.lax.cond(x[0] > 0, lambda a: a + 1.0, lambda a: a - 1.0, y)

  closed = jax.make_jaxpr(f)(jnp.ones(3))
  assert len(closed.jaxpr.eqns) == 6
  assert hlo.count_jaxpr_equations(closed) == 9
  assert hlo.count_jaxpr_equations(closed.jaxpr) == 9


def test_count_jaxpr_equations_descends_into_scan():
  def f(x):
    return jax.lax.scan(lambda c, a: (c + a, c * a), jnp.zeros((), jnp.float32), x)

  # The scan equation plus add and mul in its body.
  assert hlo.count_jaxpr_equations(jax.make_jaxpr(f)(jnp.ones(3))) == 3


def test_count_jaxpr_equations_rejects_non_jaxpr():
  with pytest.raises(TypeError, match=r"jaxpr must be a jax ClosedJaxpr or Jaxpr .*got str"):
    hlo.count_jaxpr_equations("{ lambda ; }")
