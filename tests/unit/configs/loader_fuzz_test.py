"""Fuzzing the configuration loader: whatever the YAML files and `key=value` overrides hold, the result is a
loaded config or a `ConfigError` (never a KeyError, TypeError, YAML or codec error), and an accepted config is
one the decode path can use (its sampling keys make valid SamplingParams). The CLI turns every rejection into
exit status 2 and one line."""

import pathlib
import shutil

import hypothesis
import pytest
from hypothesis import strategies as st

from maxtext import decode, decode_run
from maxtext.configs import load_config
from maxtext.configs.errors import ConfigError
from maxtext.configs.loader import BASE_CONFIG_PATH, base_key_types

KEYS = sorted(base_key_types())
# Keys whose values decide what is built; fuzzing them with random values exercises every range and combination
# check. Sources (paths, model_name) are left out: they are about files, tested below.
SHAPE_KEYS = [k for k in KEYS if k not in ("load_parameters_path", "hf_model_path", "tokenizer_path", "model_name")]
_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_VALUES = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.sampled_from(["0", "-1", "1", "nan", "inf", "-inf", "1e309", "true", "false", "", "[]", "[1, 2", "[a, b]"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.lists(st.integers(-5, 600), max_size=4).map(str),
    st.lists(st.sampled_from(["full_attention", "sliding_attention", "linear_attention", "x"]), max_size=4).map(str),
    _TEXT,
)


def _accepts_or_config_error(argv):
  try:
    cfg = load_config(argv)
  except ConfigError:
    return None
  decode_run.sampling_params_from_config(cfg)  # an accepted config must give valid SamplingParams
  return cfg


@pytest.mark.slow
@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(
    overrides=st.dictionaries(st.sampled_from(SHAPE_KEYS), _VALUES, max_size=4),
    model=st.sampled_from(["default", "qwen3-next-tiny", "gemma3-tiny", "kvshare-tiny", "qwen3.5-tiny"]),
)
def test_property_random_overrides_load_or_raise_config_error(overrides, model):
  argv = [BASE_CONFIG_PATH, f"model_name={model}"] + [f"{k}={v}" for k, v in overrides.items()]
  _accepts_or_config_error(argv)


@pytest.mark.slow
@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(key=_TEXT, value=_VALUES)
def test_property_unknown_or_malformed_arguments_are_config_errors(key, value):
  hypothesis.assume(key.strip() not in KEYS)
  with pytest.raises(ConfigError):
    load_config([BASE_CONFIG_PATH, f"{key}={value}" if "=" not in key else key])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("decode_sampling_temperature", "nan", r"decode_sampling_temperature=nan: must be a finite number"),
        ("decode_sampling_nucleus_p", "nan", r"decode_sampling_nucleus_p=nan: must be a finite number"),
        ("rope_max_timescale", "inf", r"rope_max_timescale=inf: must be a finite number"),
        ("partial_rotary_factor", "-inf", r"partial_rotary_factor=-inf: must be a finite number"),
        ("num_kv_blocks", "-4", r"num_kv_blocks=-4: must be >= 0"),
        ("max_num_seqs", "0", r"max_num_seqs=0: must be > 0"),
        ("seed", "-1", r"seed=-1: must be >= 0"),
    ],
)
def test_non_finite_and_negative_values_name_the_key(key, value, message):
  with pytest.raises(ConfigError, match=message):
    load_config([BASE_CONFIG_PATH, f"{key}={value}"])


@pytest.fixture(name="config_copy")
def fixture_config_copy(tmp_path):
  """A copy of the package's base.yml and models/ in tmp_path; returns the base path."""
  base = tmp_path / "base.yml"
  shutil.copy(BASE_CONFIG_PATH, base)
  shutil.copytree(pathlib.Path(BASE_CONFIG_PATH).parent / "models", tmp_path / "models")
  return base


@pytest.mark.slow
@hypothesis.settings(
    max_examples=150, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(data=st.data())
def test_property_mutated_yaml_files_load_or_raise_config_error(config_copy, data):
  original = pathlib.Path(BASE_CONFIG_PATH).read_bytes()
  lines = original.split(b"\n")
  mutation = data.draw(st.sampled_from(["truncate", "drop_line", "duplicate_line", "replace_value", "garbage", "empty"]))
  if mutation == "truncate":
    content = original[: data.draw(st.integers(0, len(original)))]
  elif mutation == "drop_line":
    del lines[data.draw(st.integers(0, len(lines) - 1))]
    content = b"\n".join(lines)
  elif mutation == "duplicate_line":
    i = data.draw(st.integers(0, len(lines) - 1))
    lines.insert(i, lines[i])
    content = b"\n".join(lines)
  elif mutation == "replace_value":
    i = data.draw(st.sampled_from([i for i, line in enumerate(lines) if b": " in line and not line.startswith(b"#")]))
    key = lines[i].split(b":")[0]
    lines[i] = key + b": " + data.draw(_VALUES).encode("utf-8")
    content = b"\n".join(lines)
  elif mutation == "garbage":
    content = data.draw(st.binary(max_size=200))
  else:
    content = b""
  config_copy.write_bytes(content)
  model_file = config_copy.parent / "models" / "fuzz.yml"
  model_file.write_bytes(data.draw(st.sampled_from([b"", b"decoder_block: qwen3\n", content[:300], b"- a\n- b\n"])))
  _accepts_or_config_error([str(config_copy)])
  _accepts_or_config_error([str(config_copy), "model_name=fuzz"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["max_num_seqs=-2"], "max_num_seqs=-2: must be > 0"),
        (["decode_sampling_temperature=nan"], "decode_sampling_temperature=nan: must be a finite number"),
        (["layer_types=[full_attention"], "layer_types='[full_attention' (command line): not a valid list"),
        (["base_num_decoder_layers=3", "layer_types=[full_attention]"], "layer_types=['full_attention']: must have one"),
        (["num_kv_blocks=1", "num_kv_blocks=2"], "num_kv_blocks is set twice on the command line"),
    ],
)
def test_cli_rejections_are_exit_2_and_one_line(capsys, argv, message):
  assert decode.main([BASE_CONFIG_PATH] + argv) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.count("\n") == 1, captured.err
  assert captured.err.startswith(f"maxtext-decode: error: {message}"), captured.err


@pytest.mark.parametrize(
    "content", [b"", b"\xff\xfe\x00", b"key: [unclosed", b"- just\n- a list\n", b"model_name: 3\n", b"prompt: \x1f\n"]
)
def test_cli_bad_yaml_files_are_exit_2_and_one_line(capsys, tmp_path, content):
  path = tmp_path / "bad.yml"
  path.write_bytes(content)
  assert decode.main([str(path)]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.count("\n") == 1, captured.err
  assert captured.err.startswith("maxtext-decode: error: ") and str(path) in captured.err, captured.err
