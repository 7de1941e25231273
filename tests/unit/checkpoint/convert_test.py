"""Tests of the Hugging Face -> Orbax converter and its command line."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from maxtext.checkpoint import convert, hf, load_model
from maxtext.models import get_flat_params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.hf
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_convert_round_trip(weight_dtype, hf_checkpoint, tmp_path, capsys):
  folder, _ = hf_checkpoint("qwen3_next_moe")
  out = tmp_path / "out"
  argv = ["--hf_model_path", str(folder), "--output_dir", str(out), "--weight_dtype", weight_dtype]
  assert convert.main(argv) == 0
  captured = capsys.readouterr()
  assert f"wrote {out / 'params'}" in captured.out
  assert "Loading" in captured.err  # tqdm progress bar
  keys = yaml.safe_load((out / "maxtext_model.yml").read_text(encoding="utf-8"))
  assert keys["load_parameters_path"] == str(out / "params") and keys["tokenizer_path"] == str(folder)
  assert keys["decoder_block"] == "qwen3_next" and keys["weight_dtype"] == weight_dtype
  cfg = convert.load_converted_config(out, dtype="float32")
  restored = get_flat_params(load_model(cfg))
  ref_cfg = hf.load_hf_config(folder, weight_dtype=weight_dtype)
  reference = hf.load_hf_params(folder, ref_cfg)
  assert sorted(restored) == sorted(reference)
  for name, value in reference.items():
    assert restored[name].dtype == value.dtype == jnp.dtype(weight_dtype), name
    np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)
  assert cfg.layer_types == ref_cfg.layer_types and cfg.moe_layers == ref_cfg.moe_layers


@pytest.mark.hf
def test_convert_refuses_an_existing_output(hf_checkpoint, tmp_path, capsys):
  folder, _ = hf_checkpoint("qwen3_untied")
  argv = ["--hf_model_path", str(folder), "--output_dir", str(tmp_path), "--no_progress"]
  assert convert.main(argv) == 0
  assert "Loading" not in capsys.readouterr().err
  assert convert.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert err.startswith("convert_hf_checkpoint: error: output_dir ") and "already holds a converted checkpoint" in err


def test_convert_errors_are_one_line_exit_2(tmp_path, capsys):
  assert convert.main(["--hf_model_path", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "folder '" in err and "nope' does not exist" in err
  (tmp_path / "config.json").write_text('{"model_type": "bert"}', encoding="utf-8")
  assert convert.main(["--hf_model_path", str(tmp_path), "--output_dir", str(tmp_path / "o")]) == 2
  assert "model_type 'bert' is not supported" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["--hf_model_path", str(tmp_path)])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err == "convert_hf_checkpoint: error: the following arguments are required: --output_dir\n"
  with pytest.raises(FileNotFoundError, match=r"has no maxtext_model.yml; is it a converted checkpoint\?"):
    convert.load_converted_config(tmp_path)


@pytest.mark.slow
def test_script_runs_as_a_subprocess(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
  script = os.path.join(REPO, "scripts", "convert_hf_checkpoint.py")
  result = subprocess.run(
      [sys.executable, script, "--hf_model_path", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o")],
      capture_output=True,
      text=True,
      env=env,
      check=False,
      timeout=300,
  )
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith("convert_hf_checkpoint: error: Hugging Face model folder")
