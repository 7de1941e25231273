"""prompts_file= parsing: plain lines, JSON Lines, and errors naming the line."""

import pytest

from maxtext.inference.prompts_file import FilePrompt, PromptsFileError, read_prompts_file


def _write(tmp_path, text, name="p.txt"):
  path = tmp_path / name
  path.write_text(text, encoding="utf-8")
  return str(path)


def test_one_prompt_per_line_blank_lines_skipped(tmp_path):
  path = _write(tmp_path, "What is 2+2?\n\n  Say hi  \n")
  assert read_prompts_file(path) == [FilePrompt(1, "What is 2+2?"), FilePrompt(3, "  Say hi  ")]


def test_json_lines_with_prompt_or_token_ids(tmp_path):
  path = _write(tmp_path, '{"prompt": "a\\nb"}\n\n{"prompt_token_ids": [1, 2, 3]}\n', "p.jsonl")
  assert read_prompts_file(path) == [FilePrompt(1, "a\nb"), FilePrompt(3, [1, 2, 3])]


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"prompt": "x"', "line 2: not valid JSON"),
        ('["x"]', "line 2: must be a JSON object"),
        ('{"prompt": "x", "prompt_token_ids": [1]}', "line 2: must hold exactly one of"),
        ('{"text": "x"}', "line 2: must hold exactly one of"),
        ('{"prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
        ('{"prompt_token_ids": [1, -2]}', "line 2: 'prompt_token_ids' must be a non-empty list of non-negative ints"),
        ('{"prompt_token_ids": [true]}', "line 2: 'prompt_token_ids' must be"),
        ('{"prompt_token_ids": []}', "line 2: 'prompt_token_ids' must be"),
    ],
)
def test_a_malformed_json_line_is_named(tmp_path, line, match):
  path = _write(tmp_path, '{"prompt": "ok"}\n' + line + "\n")
  with pytest.raises(PromptsFileError, match=match):
    read_prompts_file(path)


def test_missing_blank_and_non_utf8_files(tmp_path):
  with pytest.raises(PromptsFileError, match="does not exist"):
    read_prompts_file(str(tmp_path / "absent.txt"))
  with pytest.raises(PromptsFileError, match="holds no prompt"):
    read_prompts_file(_write(tmp_path, "\n  \n"))
  path = tmp_path / "bin.txt"
  path.write_bytes(b"\xff\xfe\x00")
  with pytest.raises(PromptsFileError, match="not UTF-8 text"):
    read_prompts_file(str(path))
