"""The mixer protocol: what `register_mixer` requires of a layer kind, and the dense forward it does not."""

import jax.numpy as jnp
import pytest
from flax import nnx

from maxtext.kv_cache.cache_spec import RecurrentSpec
from maxtext.layers import mixer
from maxtext.layers.attention import Attention
from maxtext.layers.gated_delta_net import GatedDeltaNet
from maxtext.layers.mamba2 import Mamba2


class _RunnerOnly(mixer.Mixer):
  """A kind with only the runner path: no dense full-sequence forward."""

  layer_types = ("runner_only_test_kind",)
  cache_kind = "recurrent"
  param_name = "runner_only"

  @classmethod
  def from_config(cls, cfg, layer_index, *, rngs):
    """No parameters."""
    del cfg, layer_index, rngs
    return cls()

  @classmethod
  def cache_spec(cls, cfg, layer_index):
    """One fp32 row of 4 per state slot."""
    return RecurrentSpec(cfg.layer_types[layer_index], ("sum",), ((4,),), ("float32",))

  @classmethod
  def declare(cls, cfg, layer_index, stored=()):
    """No parameters."""
    del cfg, layer_index, stored
    return []

  def paged(self, x, positions, cache, md, backend):
    """The identity, the cache unchanged."""
    del positions, md, backend
    return x, cache


def test_a_kind_without_a_dense_forward_registers_and_says_so_when_called():
  assert "__call__" not in mixer.PROTOCOL_METHODS
  assert mixer.register_mixer(_RunnerOnly) is _RunnerOnly
  assert mixer.get_mixer_class("runner_only_test_kind") is _RunnerOnly
  layer = _RunnerOnly.from_config(None, 0, rngs=nnx.Rngs(0))
  x = jnp.ones((3, 4))
  assert layer.paged(x, jnp.arange(3), "cache", None, None)[1] == "cache"
  with pytest.raises(NotImplementedError, match=r"_RunnerOnly has no dense full-sequence forward .*paged\(\)"):
    layer(x[None], jnp.arange(3)[None])


def test_a_kind_without_the_runner_path_is_refused():

  class _DenseOnly(mixer.Mixer):
    layer_types = ("dense_only_test_kind",)
    cache_kind = "recurrent"
    param_name = "dense_only"
    from_config = _RunnerOnly.from_config
    cache_spec = _RunnerOnly.cache_spec
    declare = _RunnerOnly.declare

    def __call__(self, x, positions, shared_kv=None, *, chunked=True):  # pylint: disable=arguments-differ
      return x, None

  with pytest.raises(ValueError, match=r"_DenseOnly must define paged \(the mixer protocol\)"):
    mixer.register_mixer(_DenseOnly)
  assert "dense_only_test_kind" not in mixer.registered_layer_types()


@pytest.mark.parametrize("cls", [Attention, GatedDeltaNet, Mamba2])
def test_the_built_in_kinds_keep_the_dense_forward_the_tests_compare_with(cls):
  assert "__call__" in vars(cls)
