"""Damaged and mismatched checkpoints: each gives one clear error naming the tensor, key or file.

Covers what the per-module tests do not: truncated files (safetensors and Orbax), a folder that is not an Orbax
checkpoint (or the converter's output instead of its params/), a config.json that disagrees with the weights,
another model's weights, and a conversion that fails half-way leaving nothing behind.
"""

import json
import logging
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from maxtext.checkpoint import convert, hf, orbax
from maxtext.checkpoint.safetensors_index import SafetensorsIndex


def _safetensors_folder(folder, size=16):
  folder.mkdir()
  save_file({"model.norm.weight": np.ones(size, np.float32)}, str(folder / "model.safetensors"))
  return folder / "model.safetensors"


@pytest.mark.parametrize("keep", [4, 50, -8])
def test_truncated_safetensors_names_the_file(tmp_path, keep):
  path = _safetensors_folder(tmp_path / "hf")
  data = path.read_bytes()
  path.write_bytes(data[:keep])
  with pytest.raises(ValueError, match=r"model.safetensors in '.*hf' is not a readable safetensors file \(truncated"):
    SafetensorsIndex(tmp_path / "hf")


def test_orbax_probe_of_a_plain_folder_logs_nothing_and_says_what_it_is(tmp_path, caplog):
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "notes.txt").write_text("hello", encoding="utf-8")
  with caplog.at_level(logging.DEBUG):
    with pytest.raises(ValueError, match=r"'.*plain' is not an Orbax parameter checkpoint \(it has no _METADATA file\)$"):
      orbax.checkpoint_param_shapes(tmp_path / "plain")
  assert not [r for r in caplog.records if r.name.startswith("absl")], caplog.text


def test_converter_output_folder_points_at_its_params(tmp_path):
  orbax.save_params(tmp_path / "out" / "params", {"x": np.zeros(2, np.float32)})
  match = r"'.*out' is not an Orbax parameter checkpoint .*; it holds a converted checkpoint, so point at .*params'"
  with pytest.raises(ValueError, match=match):
    orbax.checkpoint_param_shapes(tmp_path / "out")


def test_orbax_path_that_is_a_file(tmp_path):
  (tmp_path / "f").write_text("x", encoding="utf-8")
  with pytest.raises(ValueError, match=r"Orbax checkpoint directory '.*f' is a file, not a folder"):
    orbax.checkpoint_param_shapes(tmp_path / "f")


@pytest.mark.parametrize("damage", ["truncate_metadata", "truncate_data", "drop_data"])
def test_damaged_orbax_checkpoint_is_a_value_error(tmp_path, damage):
  path = orbax.save_params(tmp_path / "ck", {"a.b": np.arange(6, dtype=np.float32).reshape(2, 3)})
  if damage == "truncate_metadata":
    with open(os.path.join(path, "_METADATA"), "r+b") as f:
      f.truncate(7)
  else:
    for root, _, files in os.walk(path):
      for name in files:
        if os.path.basename(root) == "d":
          full = os.path.join(root, name)
          if damage == "drop_data":
            os.remove(full)
          else:
            with open(full, "r+b") as f:
              f.truncate(10)
  with pytest.raises(ValueError, match=r"Orbax checkpoint '.*ck' has (unreadable|no readable array) metadata"):
    orbax.checkpoint_param_shapes(path)


@pytest.mark.hf
def test_config_json_disagreeing_with_the_weights_names_the_tensor(hf_checkpoint, tmp_path, rewrite_checkpoint):
  folder, _ = hf_checkpoint("qwen3_untied")
  bad = tmp_path / "bad"
  rewrite_checkpoint(folder, bad, config=lambda raw: dict(raw, intermediate_size=96))
  with pytest.raises(
      ValueError,
      match=r"tensor 'model.layers.0.mlp.gate_proj.weight' .* has shape \(128, 64\), but the config expects \(96, 64\)",
  ):
    hf.iter_hf_params(bad, hf.load_hf_config(bad))


@pytest.mark.hf
def test_another_models_weights_are_named_as_missing(hf_checkpoint, tmp_path, rewrite_checkpoint):
  llama, _ = hf_checkpoint("llama")
  hybrid, _ = hf_checkpoint("qwen3_next_dense")
  bad = tmp_path / "bad"
  other_config = json.loads((hybrid / "config.json").read_text(encoding="utf-8"))
  rewrite_checkpoint(llama, bad, config=lambda raw: other_config)
  with pytest.raises(ValueError, match=r"is missing \d+ tensors: 'model.layers.0.linear_attn\."):
    hf.iter_hf_params(bad, hf.load_hf_config(bad))


@pytest.mark.hf
@pytest.mark.parametrize("existing_output", [False, True], ids=["new_folder", "existing_empty_folder"])
def test_a_failed_conversion_leaves_nothing(hf_checkpoint, tmp_path, monkeypatch, existing_output):
  folder, _ = hf_checkpoint("qwen3_untied")
  out = tmp_path / "out"
  if existing_output:
    out.mkdir()

  def fail_after_writing(directory, params):
    os.makedirs(directory)
    with open(os.path.join(directory, "partial"), "w", encoding="utf-8") as f:
      f.write("half an array")
    del params
    raise OSError("disk full")

  monkeypatch.setattr(orbax, "save_params", fail_after_writing)
  assert convert.main(["--hf_model_path", str(folder), "--output_dir", str(out), "--no_progress"]) == 2
  assert sorted(os.listdir(tmp_path)) == (["out"] if existing_output else [])
  if existing_output:
    assert not os.listdir(out)


@pytest.mark.hf
def test_conversion_renames_its_staging_folder_into_place(hf_checkpoint, tmp_path):
  folder, _ = hf_checkpoint("qwen3_untied")
  convert.convert(folder, tmp_path / "out", progress=False)
  assert sorted(os.listdir(tmp_path)) == ["out"]
  assert sorted(os.listdir(tmp_path / "out")) == ["maxtext_model.yml", "params"]
