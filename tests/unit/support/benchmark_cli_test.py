"""The benchmark scripts' shared command-line pieces."""

import argparse
import json

import pytest

from support.benchmark_cli import add_output_flags, emit, positive_int


def test_positive_int_takes_integers_of_at_least_one():
  assert positive_int("1") == 1 and positive_int("384") == 384
  for text in ("0", "-3", "1.5", "many"):
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be a positive integer, got {text}"):
      positive_int(text)


def test_a_bad_value_is_a_usage_error_naming_the_option(capsys):
  parser = argparse.ArgumentParser(prog="bench")
  parser.add_argument("--repeats", type=positive_int)
  add_output_flags(parser, "a smoke run")
  with pytest.raises(SystemExit) as exit_info:
    parser.parse_args(["--repeats", "0"])
  assert exit_info.value.code == 2
  assert "argument --repeats: must be a positive integer, got 0" in capsys.readouterr().err
  args = parser.parse_args(["--quick", "--json"])
  assert args.quick and args.json and args.repeats is None
  assert "a smoke run" in parser.format_help()


def test_emit_prints_one_json_object_or_the_lines(capsys):
  payload = {"results": [{"x": 1}], "settings": {"quick": True}}
  emit(True, payload, ["header", "table"])
  assert json.loads(capsys.readouterr().out) == payload
  emit(False, payload, ["header", "a | b"])
  assert capsys.readouterr().out == "header\na | b\n"
