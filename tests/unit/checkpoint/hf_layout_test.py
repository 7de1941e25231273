"""The model's Hugging Face checkpoint mapping, as its parameters declare it."""

import pytest

from maxtext.checkpoint import hf_layout
from maxtext.configs import available_models, load_config
from maxtext.models import flat_param_shapes


@pytest.mark.parametrize(
    "model_name, overrides",
    # Each real-size config takes seconds: those run in the slow set, the tiny ones (the same recipes) in the quick one.
    [
        (name, {}) if name.endswith("-tiny") else pytest.param(name, {}, marks=pytest.mark.slow)
        for name in available_models()
    ]
    + [
        ("qwen3-next-tiny", {"shared_expert_mlp_dim": 0}),
        ("llama-tiny", {"attention_bias": True, "mlp_bias": True}),
        ("qwen3-tiny", {"attention_bias": True, "logits_via_embedding": True}),
    ],
)
def test_recipe_targets_are_exactly_the_model_parameters(model_name, overrides):
  cfg = load_config(model_name=model_name, **overrides)
  targets = {name: shape for r in hf_layout.build_recipes(cfg) for name, shape in r.targets}
  expected = {name: tuple(s.shape) for name, s in flat_param_shapes(cfg).items()}
  assert targets == expected
