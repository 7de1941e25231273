"""Tests of building a model from a config's checkpoint keys."""

import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import hf, load_model, save_params
from maxtext.configs import load_config
from maxtext.models import Transformer, get_flat_params


def _assert_same(a, b):
  assert sorted(a) == sorted(b)
  for name, value in a.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(b[name]), err_msg=name)


def test_random_init_when_no_checkpoint_is_configured():
  cfg = load_config(model_name="llama-tiny", init_seed=3)
  _assert_same(get_flat_params(load_model(cfg)), get_flat_params(Transformer(cfg, rngs=nnx.Rngs(3))))


def test_orbax_checkpoint_wins(tmp_path):
  cfg = load_config(model_name="llama-tiny", init_seed=5)
  source = Transformer(cfg, rngs=nnx.Rngs(5))
  path = save_params(tmp_path / "ckpt", source)
  loaded = load_model(load_config(model_name="llama-tiny", load_parameters_path=path, hf_model_path="/not/used"))
  _assert_same(get_flat_params(loaded), get_flat_params(source))


@pytest.mark.hf
def test_hf_model_path(hf_checkpoint):
  folder, _ = hf_checkpoint("qwen3_tied")
  cfg = hf.load_hf_config(folder)
  _assert_same(get_flat_params(load_model(cfg, progress=False)), hf.load_hf_params(folder, cfg))
