"""Tests of the safetensors folder index: name normalisation, file discovery, dtypes."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.flax import save_file as save_jax
from safetensors.numpy import save_file

from maxtext.checkpoint.safetensors_index import SafetensorsIndex, normalize_name


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.language_model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("language_model.model.norm.weight", "model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("mtp.layers.0.input_layernorm.weight", None),
        ("model.visual.blocks.0.norm1.weight", None),
        ("vision_tower.vision_model.post_layernorm.weight", None),
        ("model.multi_modal_projector.mm_input_projection_weight", None),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ],
)
def test_normalize_name(name, expected):
  assert normalize_name(name) == expected


def test_index_over_several_files_reads_bf16_and_float(tmp_path):
  bf16 = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 3
  save_jax({"model.language_model.embed_tokens.weight": bf16}, str(tmp_path / "a.safetensors"))
  save_file(
      {"model.norm.weight": np.arange(4, dtype=np.float16), "mtp.fc.weight": np.ones(2, np.float32)},
      str(tmp_path / "b.safetensors"),
  )
  with SafetensorsIndex(tmp_path) as index:
    assert sorted(index.tensors) == ["model.embed_tokens.weight", "model.norm.weight"]
    info = index.tensors["model.embed_tokens.weight"]
    assert (info.name, info.shape, info.dtype) == ("model.language_model.embed_tokens.weight", (2, 3), "BF16")
    embed = index.read("model.embed_tokens.weight")
    assert embed.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(embed, np.asarray(bf16))
    norm = index.read("model.norm.weight")
    assert norm.dtype == np.float16
    np.testing.assert_array_equal(norm, np.arange(4, dtype=np.float16))


def test_duplicate_names_across_files(tmp_path):
  save_file({"model.norm.weight": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
  save_file({"language_model.model.norm.weight": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
  with pytest.raises(
      ValueError,
      match=r"tensor 'language_model.model.norm.weight' in b.safetensors and "
      r"'model.norm.weight' in a.safetensors both map to 'model.norm.weight'",
  ):
    SafetensorsIndex(tmp_path)
