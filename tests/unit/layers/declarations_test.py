"""Parameter declarations: nesting, the recipes they assemble into, and the errors that name what is wrong."""

import numpy as np
import pytest

from maxtext.layers import declarations, tensor_sources
from maxtext.layers.declarations import ParamDecl, StoredTensors


def test_nesting_keeps_a_shared_source_shared():
  split = tensor_sources.split_rows("in_proj.weight", (2, 3), 4)
  child = [ParamDecl("a.kernel", ("embed", None), split, 0), ParamDecl("b.kernel", ("embed", None), split, 1)]
  nested = declarations.nest(child, "layers.0.mixer.", "model.layers.0.")
  assert [d.name for d in nested] == ["layers.0.mixer.a.kernel", "layers.0.mixer.b.kernel"]
  assert nested[0].source is nested[1].source and nested[0].source.tensors == ("model.layers.0.in_proj.weight",)
  recipes = declarations.recipes(nested)
  assert len(recipes) == 1
  recipe = recipes[0]
  assert recipe.sources == ("model.layers.0.in_proj.weight",)
  assert recipe.targets == (("layers.0.mixer.a.kernel", (4, 2)), ("layers.0.mixer.b.kernel", (4, 3)))
  w = np.arange(20.0).reshape(5, 4)
  a, b = recipe.convert(lambda j: w, np.float32)
  np.testing.assert_array_equal(np.concatenate([a, b], axis=1), w.T)


def test_recipes_follow_the_first_parameter_of_each_source():
  norm = tensor_sources.same("n.weight", (4,))
  split = tensor_sources.split_rows("w", (1, 1), 4)
  decls = [
      ParamDecl("up", (None, None), split, 1),
      ParamDecl("norm", (None,), norm),
      ParamDecl("gate", (None, None), split, 0),
  ]
  recipes = declarations.recipes(decls)
  assert [r.sources for r in recipes] == [("w",), ("n.weight",)]
  assert [name for name, _ in recipes[0].targets] == ["gate", "up"]  # in part order


def test_declaration_errors_name_the_parameter():
  split = tensor_sources.split_rows("in_proj.weight", (2, 3), 4)
  with pytest.raises(ValueError, match=r"in_proj.weight make 2 parameters but only \['a'\] are declared"):
    declarations.recipes([ParamDecl("a", (None, None), split, 0)])
  with pytest.raises(ValueError, match=r"parameter 'b' is part 0 of a source with 2 outputs"):
    declarations.recipes([ParamDecl("a", (None, None), split, 0), ParamDecl("b", (None, None), split, 0)])
  with pytest.raises(NotImplementedError, match=r"parameter 'layers.1.toy.out.kernel' has no checkpoint source"):
    declarations.recipes([ParamDecl("layers.1.toy.out.kernel", (None, None))])
  with pytest.raises(NotImplementedError, match="not this layout"):
    declarations.recipes([ParamDecl("q.bias", (None,), tensor_sources.refused("not this layout"))])
  with pytest.raises(ValueError, match=r"parameter 'x' is declared twice"):
    declarations.axes_by_name([ParamDecl("x", (None,)), ParamDecl("x", ("embed",))])
  assert declarations.axes_by_name([ParamDecl("x", ("embed", None))]) == {"x": ("embed", None)}


def test_stored_tensors_are_seen_from_a_module():
  stored = StoredTensors({"model.layers.3.mlp.experts.gate_up_proj"})
  layer = stored.under("model.layers.3.")
  assert "mlp.experts.gate_up_proj" in layer and "experts.gate_up_proj" in layer.under("mlp.")
  assert "experts.gate_up_proj" not in stored.under("model.layers.2.mlp.")
  assert 3 not in layer and "anything" not in StoredTensors()
