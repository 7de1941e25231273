"""What the pages show of the CLI is what the CLI does: the README's `dry_run` sample is the program's output for the
README's `dry_run` command (a sample line `...` stands for any number of lines), `--help` keeps its layout, and the
pages hold no path of one machine and no snippet whose output runs into the prompt."""

import os
import pathlib
import re
import shlex
import textwrap

import pytest

from maxtext import decode
from maxtext.configs import load_config

ROOT = pathlib.Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINE = 122  # pyproject's line length: the help fits the same width as the code


def _sample_regex(sample: str) -> re.Pattern:
  """A pattern matching the whole of an output `sample` describes: each line verbatim, `...` any lines."""
  parts = ["(?:.*\n)*?" if line == "..." else re.escape(line) + "\n" for line in sample.splitlines()]
  return re.compile("".join(parts))


@pytest.mark.parametrize(
    "output, matches",
    [
        ("a\nb\nc\n", True),
        ("a\nc\n", True),  # `...` may stand for no line
        ("a\nb\nc\nd\n", False),  # a line after the sample's last is not allowed
        ("a\nb\nC\n", False),
    ],
)
def test_the_sample_matcher(output, matches):
  assert bool(_sample_regex("a\n...\nc").fullmatch(output)) == matches


def _readme_dry_run_command() -> list[str]:
  (line,) = [line for line in README.splitlines() if line.startswith("maxtext-decode ") and "dry_run=true" in line]
  return shlex.split(line, comments=True)[1:]


def _readme_dry_run_sample() -> str:
  start = README.index("- `dry_run=true` prints the cache layout")
  block = README[README.index("```\n", start) + 4 :]
  return textwrap.dedent(block[: block.index("```")])


def test_the_readme_dry_run_sample_is_what_the_program_prints(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)  # the command's configs/base.yml is relative to the checkout
  args = _readme_dry_run_command()
  assert args == ["configs/base.yml", "model_name=qwen3-next-tiny", "dry_run=true"]
  assert decode.main(args) == 0
  out = capsys.readouterr().out
  sample = _readme_dry_run_sample()
  assert sample.count("\n") >= 5 and not sample.startswith("...")
  assert _sample_regex(sample).fullmatch(out), f"README sample:\n{sample}\nprogram output:\n{out}"


def _help_text(capsys) -> list[str]:
  assert decode.main(["--help"]) == 0
  return capsys.readouterr().out.splitlines()


def test_help_lines_fit_the_line_length(capsys):
  too_long = [line for line in _help_text(capsys) if len(line) > MAX_LINE]
  assert not too_long, too_long


def test_help_has_no_line_broken_by_a_run_of_spaces(capsys):
  # Inside a line (after its indentation) a run of 3 or more spaces may only align a `# comment`.
  broken = [line for line in _help_text(capsys) if re.search(r"\S {3,}(?![ #])", line)]
  assert not broken, broken


def test_help_examples_align_their_comments_and_continue_on_indented_lines(capsys):
  examples = [line for line in _help_text(capsys) if line.startswith("    ")]
  commands = [line for line in examples if line.startswith("    maxtext-decode ")]
  assert len(commands) >= 4, examples
  columns = {line.index("  # ") for line in examples if "  # " in line}
  assert len(columns) == 1, f"the examples' comments start in different columns {sorted(columns)}"
  for line, after in zip(examples, examples[1:] + [""]):
    if line.rstrip().endswith("\\"):
      assert after.startswith("        ") and not after.startswith("        maxtext-decode"), (line, after)
  for line in commands:
    shlex.split(line.rstrip(" \\"), comments=True)  # every command line is one a shell can read


def test_the_readme_commands_name_existing_configs():
  # The help's and README's example commands run from a checkout: their first argument is a file there.
  for line in README.splitlines():
    if line.startswith("maxtext-decode "):
      assert os.path.isfile(ROOT / shlex.split(line.rstrip(" \\"), comments=True)[1]), line


def _doc_pages() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_pages_name_no_one_machines_absolute_paths():
  # A path of the machine a page was written on (a venv, a checkout) means nothing on the reader's.
  found = [
      f"{page.name}:{number}: {line}"
      for page in _doc_pages()
      for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
      if re.search(r"(?<![\w.~])/(?:work|home|root|Users|tmp)/\w", line)
  ]
  assert not found, found


def test_the_readme_python_snippet_ends_a_streamed_answer_with_a_newline():
  start = README.index("```python\n")
  snippet = README[start : README.index("```\n", start + 10)].splitlines()
  streamed = [i for i, line in enumerate(snippet) if 'end=""' in line]
  assert streamed, "the snippet streams an answer"
  assert any(line.startswith("print(") and 'end=""' not in line for line in snippet[streamed[-1] + 1 :]), snippet


def test_the_reliability_page_names_test_files_that_exist():
  page = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
  names = set(re.findall(r"`(?:tests/[\w/]+/)?(\w+_test\.py)`", page))
  assert {"gguf_test.py", "gguf_format_test.py", "cli_faults_test.py"} <= names, names  # GGUF faults are covered
  existing = {path.name for path in (ROOT / "tests").rglob("*_test.py")}
  assert names <= existing, sorted(names - existing)


def test_every_key_the_help_names_is_a_config_key(capsys, monkeypatch):
  monkeypatch.chdir(ROOT)  # the examples' configs/base.yml is relative to the checkout
  lines = _help_text(capsys)
  text = "\n".join(lines).replace("\\\n", " ")
  examples = [line.strip() for line in text.splitlines() if line.strip().startswith("maxtext-decode ")]
  assert len(examples) >= 4, examples
  for line in examples:
    load_config(shlex.split(line, comments=True)[1:])  # an unknown key or a bad value raises, naming it
  named = set(re.findall(r"(?<![\w-])([a-z][a-z_]+)=", text)) - {"key"}  # the usage line's `key=value`
  unknown = sorted(named - set(load_config([str(ROOT / "configs" / "base.yml")]).keys()))
  assert not unknown, f"maxtext-decode --help names keys configs/base.yml does not have: {unknown}"
