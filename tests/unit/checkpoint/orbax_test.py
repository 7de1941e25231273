"""Tests of Orbax save/restore of model parameters."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import orbax
from maxtext.configs import load_config
from maxtext.models import Transformer, flat_param_shapes, get_flat_params


def _model(model_name: str, seed: int = 0, **overrides):
  cfg = load_config(model_name=model_name, init_seed=seed, **overrides)
  return cfg, Transformer(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_name, weight_dtype",
    [("qwen3-tiny", "float32"), ("qwen3-tiny", "bfloat16"), ("qwen3-next-tiny", "float32"), ("gemma3-tiny", "float32")],
)
def test_save_then_restore_is_bitwise_identical(model_name, weight_dtype, tmp_path):
  cfg, model = _model(model_name, weight_dtype=weight_dtype)
  path = orbax.save_params(tmp_path / "ckpt", model)
  assert path == str(tmp_path / "ckpt")
  restored = get_flat_params(orbax.restore_model(path, cfg))
  original = get_flat_params(model)
  assert sorted(restored) == sorted(original)
  for name, value in original.items():
    assert restored[name].dtype == value.dtype == jnp.dtype(weight_dtype), name
    np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value), err_msg=name)
  shapes = orbax.checkpoint_param_shapes(path)
  assert shapes == flat_param_shapes(cfg)


def test_save_numpy_mapping_and_restore_params(tmp_path):
  params = {"a.b.kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "c": np.ones(4, ml_dtypes.bfloat16)}
  orbax.save_params(tmp_path / "p", params)
  expected = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
  restored = orbax.restore_params(tmp_path / "p", expected)
  assert isinstance(restored["a.b.kernel"], jax.Array)
  for name, value in params.items():
    assert restored[name].dtype == value.dtype
    np.testing.assert_array_equal(np.asarray(restored[name]), value)


def test_restore_with_cast_dtype(tmp_path):
  params = {"w": np.array([1.0, 1.0 + 2.0**-10, 3.5], np.float32)}
  orbax.save_params(tmp_path / "p", params)
  want = {"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
  with pytest.raises(
      TypeError,
      match=r"parameter 'w': Orbax checkpoint .* has dtype float32, the model expects "
      r"bfloat16 \(set weight_dtype=float32 or pass cast_dtype=True\)",
  ):
    orbax.restore_params(tmp_path / "p", want)
  restored = orbax.restore_params(tmp_path / "p", want, cast_dtype=True)
  assert restored["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(restored["w"]), params["w"].astype(ml_dtypes.bfloat16))


@pytest.mark.slow
def test_mismatched_restores_fail_clearly(tmp_path):
  cfg, model = _model("qwen3-tiny")
  path = orbax.save_params(tmp_path / "ckpt", model)
  bigger = load_config(model_name="qwen3-tiny", vocab_size=1024)
  with pytest.raises(
      ValueError,
      match=r"parameter 'embedder.embedding': Orbax checkpoint .* has \(512, 64\) float32, "
      r"the model expects \(1024, 64\) float32",
  ):
    orbax.restore_model(path, bigger)
  llama = load_config(model_name="llama-tiny")
  with pytest.raises(ValueError, match=r"Orbax checkpoint .* lacks \d+ parameters the model needs: "):
    orbax.restore_model(path, llama)
  no_norm = {k: v for k, v in flat_param_shapes(cfg).items() if not k.endswith("q_norm.scale")}
  with pytest.raises(ValueError, match=r"has \d+ parameters the model does not have: layers.0.attn.q_norm.scale"):
    orbax.restore_params(path, no_norm)
  bf16 = load_config(model_name="qwen3-tiny", weight_dtype="bfloat16")
  with pytest.raises(TypeError, match=r"has dtype float32, the model expects bfloat16"):
    orbax.restore_model(path, bf16)
  cast = get_flat_params(orbax.restore_model(path, bf16, cast_dtype=True))
  np.testing.assert_array_equal(
      np.asarray(cast["final_norm.scale"]),
      np.asarray(get_flat_params(model)["final_norm.scale"]).astype(ml_dtypes.bfloat16),
  )


def test_directory_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"Orbax checkpoint directory '.*missing' does not exist"):
    orbax.restore_params(tmp_path / "missing", {})
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=r"'.*empty' is not an Orbax parameter checkpoint"):
    orbax.checkpoint_param_shapes(tmp_path / "empty")
  orbax.save_params(tmp_path / "p", {"x": np.zeros(2, np.float32)})
  with pytest.raises(FileExistsError, match=r"'.*p' already exists \(pass overwrite=True to replace it\)"):
    orbax.save_params(tmp_path / "p", {"x": np.ones(2, np.float32)})
  orbax.save_params(tmp_path / "p", {"x": np.ones(2, np.float32)}, overwrite=True)
  restored = orbax.restore_params(tmp_path / "p", {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
  np.testing.assert_array_equal(np.asarray(restored["x"]), np.ones(2, np.float32))


def test_invalid_parameter_sets(tmp_path):
  with pytest.raises(ValueError, match=r"needs at least one parameter"):
    orbax.save_params(tmp_path / "a", {})
  with pytest.raises(ValueError, match=r"'a.b' collides with another parameter"):
    orbax.save_params(tmp_path / "b", {"a.b.c": np.zeros(1), "a.b": np.zeros(1)})
  with pytest.raises(ValueError, match=r"'a.b.c' collides with another parameter named by its prefix"):
    orbax.save_params(tmp_path / "c", {"a.b": np.zeros(1), "a.b.c": np.zeros(1)})
