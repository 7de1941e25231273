"""Flat parameter access: shapes from the config, round trip into an abstract model, validation errors."""

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.configs import load_config
from maxtext.models import Transformer, abstract_model, assign_params, flat_param_shapes, get_flat_params


@pytest.fixture(name="qwen3_next")
def _qwen3_next():
  cfg = load_config(model_name="qwen3-next-tiny")
  return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_flat_param_shapes_match_the_built_model(qwen3_next):
  cfg, model = qwen3_next
  shapes = flat_param_shapes(cfg)
  params = get_flat_params(model)
  assert list(shapes) == list(params)
  for name, value in params.items():
    assert shapes[name] == jax.ShapeDtypeStruct(value.shape, value.dtype), name
  assert shapes["layers.3.attn.gate.kernel"].shape == (64, 4, 32)
  bf16 = flat_param_shapes(load_config(model_name="qwen3-next-tiny", weight_dtype="bfloat16"))
  assert bf16["layers.0.gdn.A_log"].dtype == jnp.bfloat16


def test_assign_into_abstract_model_round_trips(qwen3_next):
  cfg, model = qwen3_next
  params = get_flat_params(model)
  target = abstract_model(cfg)
  assign_params(target, ((k, np.asarray(v)) for k, v in params.items()))  # a generator, NumPy arrays
  got = get_flat_params(target)
  assert all(isinstance(v, jax.Array) for v in got.values())
  for name, value in params.items():
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


def test_assign_accepts_a_mapping_and_casts_on_request():
  cfg = load_config(model_name="llama-tiny", weight_dtype="bfloat16")
  target = abstract_model(cfg)
  arrays = {k: np.full(v.shape, 0.5, np.float32) for k, v in flat_param_shapes(cfg).items()}
  with pytest.raises(TypeError, match=r"parameter 'embedder.embedding': expected dtype bfloat16, got float32 \(pass"):
    assign_params(target, arrays)
  assign_params(target, arrays, cast_dtype=True)
  emb = get_flat_params(target)["embedder.embedding"]
  assert emb.dtype == jnp.bfloat16 and float(emb[0, 0]) == 0.5
  assign_params(target, {k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()})


@pytest.mark.slow
def test_assign_moves_host_arrays_without_compiling_and_keeps_device_arrays(caplog):
  """Host arrays go to the device by `device_put` (`jnp.asarray` compiles a program per new shape); device arrays
  are kept as they are, or cast when their dtype differs."""
  cfg = load_config(model_name="llama-tiny")
  target = abstract_model(cfg)
  arrays = {k: np.full(v.shape, 0.25, v.dtype) for k, v in flat_param_shapes(cfg).items()}
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    assign_params(target, arrays)
  assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
  assert float(get_flat_params(target)["embedder.embedding"][0, 0]) == 0.25
  on_device = {k: jnp.asarray(v) for k, v in arrays.items()}
  assign_params(target, on_device)
  assert get_flat_params(target)["final_norm.scale"] is on_device["final_norm.scale"]
  bf16 = abstract_model(load_config(model_name="llama-tiny", weight_dtype="bfloat16"))
  assign_params(bf16, on_device, cast_dtype=True)
  assert get_flat_params(bf16)["final_norm.scale"].dtype == jnp.bfloat16


def _llama_arrays():
  cfg = load_config(model_name="llama-tiny")
  return cfg, {k: np.zeros(v.shape, v.dtype) for k, v in flat_param_shapes(cfg).items()}


def test_assign_rejects_unexpected_duplicate_and_missing_names():
  cfg, arrays = _llama_arrays()
  model = abstract_model(cfg)
  with pytest.raises(ValueError, match="unexpected parameter 'layers.0.attn.q_norm.scale': the model has no such"):
    assign_params(model, [("layers.0.attn.q_norm.scale", np.zeros(16, np.float32))])
  item = ("final_norm.scale", arrays["final_norm.scale"])
  with pytest.raises(ValueError, match="parameter 'final_norm.scale' given more than once"):
    assign_params(model, [item, item])
  partial = {k: v for k, v in arrays.items() if k != "lm_head.kernel" and not k.startswith("layers.3.")}
  with pytest.raises(ValueError, match=r"^10 parameters were not given: layers\.3\..*and 5 more$"):
    assign_params(model, partial)


def test_assign_rejects_bad_shapes_dtypes_and_values():
  cfg, _ = _llama_arrays()
  model = abstract_model(cfg)
  with pytest.raises(ValueError, match=r"parameter 'layers.1.attn.k.kernel': expected shape \(64, 2, 16\) float32, "
                     r"got \(64, 32\) float32"):  # fmt: skip
    assign_params(model, [("layers.1.attn.k.kernel", np.zeros((64, 32), np.float32))])
  with pytest.raises(TypeError, match="parameter 'final_norm.scale': cannot cast non-floating dtype int32"):
    assign_params(model, [("final_norm.scale", np.zeros(64, np.int32))], cast_dtype=True)
  with pytest.raises(TypeError, match="parameter 'final_norm.scale': expected an array, got list"):
    assign_params(model, [("final_norm.scale", [0.0] * 64)])
