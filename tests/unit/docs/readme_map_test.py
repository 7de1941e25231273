"""The README's map of the code names what the tree holds, and the tree holds what the map names.

The map is the fenced block under "## Map of the code". Its entries start at column 0 (`scripts/`, `docs/`,
`tests/unit/`, ...) or, under `src/maxtext/`, at column 2 (`configs/`, `decode.py`, `integration/vllm/`, ...); the
deeper-indented lines after an entry continue its description. The rules:

- every module or folder directly under `src/maxtext/` has an entry, and every module or folder of an entry's
  package is named in its description (as `name`, `name.py` or `name/`);
- every file in `scripts/` and `docs/` is named in that entry's description by its full name;
- every entry and every file name the map gives (`*.py`, `*.yml`, `*.md`, ...) exists.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC = ROOT / "src" / "maxtext"
_ENTRY = re.compile(r"^( {0,2})(\S+)(?: {2,}(.*))?$")
# A file name in a description: a word with one of the tree's extensions, possibly with a folder or a `*`.
_FILE_NAME = re.compile(r"(?<![\w./*-])([\w./*-]+\.(?:py|yml|md|sh|patch|png|cc|h))(?![\w-])")
_IGNORED = ("__init__.py", "__pycache__")


def _map_block() -> list[str]:
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  match = re.search(r"^## Map of the code\n+```\n(.*?)^```", text, re.M | re.S)
  assert match, "README.md has no fenced block under '## Map of the code'"
  return match.group(1).splitlines()


def parse_map(lines: list[str]) -> dict[str, str]:
  """`{entry path: its description}`, the entries under `src/maxtext/` as `src/maxtext/<name>`."""
  entries: dict[str, str] = {}
  current = None
  for line in lines:
    match = _ENTRY.match(line)
    if match:
      indent, name, description = match.groups()
      if indent:
        assert current is not None and current.startswith("src/maxtext"), f"map line outside src/maxtext/: {line!r}"
        name = f"src/maxtext/{name}"
      current = name.rstrip("/")
      assert current not in entries, f"the map names {name} twice"
      entries[current] = description or ""
    else:
      assert current is not None, f"map line before any entry: {line!r}"
      entries[current] += " " + line.strip()
  return entries


def _children(folder: pathlib.Path) -> list[pathlib.Path]:
  return sorted(
      p for p in folder.iterdir() if p.name not in _IGNORED and not p.name.startswith(".") and p.suffix != ".pyc"
  )


def _names(child: pathlib.Path, description: str) -> bool:
  """Whether `description` names `child`: a folder as `name/`, a module as `name` or `name.py`, any other file by
  its full name."""
  if child.is_dir():
    pattern = rf"{re.escape(child.name)}/"
  elif child.suffix == ".py":
    pattern = rf"{re.escape(child.stem)}(?:\.py)?(?![\w/-])"
  else:
    pattern = rf"{re.escape(child.name)}(?![\w-])"
  return re.search(rf"(?<![\w./-]){pattern}", description) is not None


ENTRIES = parse_map(_map_block())


def test_the_map_has_the_expected_entries():
  assert {"src/maxtext", "scripts", "docs", "tests/unit"} <= set(ENTRIES), sorted(ENTRIES)


def test_every_entry_exists():
  missing = sorted(name for name in ENTRIES if not (ROOT / name).exists())
  assert not missing, f"README map entries that are not in the tree: {missing}"


def test_every_top_level_module_and_folder_of_src_maxtext_has_an_entry():
  tops = {name.split("/")[2] for name in ENTRIES if name.startswith("src/maxtext/")}
  tree = {child.name for child in _children(SRC)}
  assert not tree - tops, f"src/maxtext/ holds these, which the README map does not name: {sorted(tree - tops)}"
  assert not tops - tree, f"the README map names these, which src/maxtext/ does not hold: {sorted(tops - tree)}"


# The test folders are described, not listed; `src/maxtext` itself is checked entry by entry above.
LISTED = sorted(n for n in ENTRIES if (ROOT / n).is_dir() and n != "src/maxtext" and not n.startswith("tests/"))


def test_the_listed_folders_are_the_expected_ones():
  assert {"scripts", "docs", "src/maxtext/kernels", "src/maxtext/layers", "src/maxtext/integration/vllm"} <= set(LISTED)


@pytest.mark.parametrize("entry", LISTED)
def test_every_file_and_module_of_a_mapped_folder_is_named(entry):
  missing = [child.name for child in _children(ROOT / entry) if not _names(child, ENTRIES[entry])]
  assert not missing, f"README map, {entry}/: not named: {missing}"


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_file_name_the_map_gives_exists(entry):
  folder = ROOT / entry if (ROOT / entry).is_dir() else ROOT
  named = _FILE_NAME.findall(ENTRIES[entry])
  extra = sorted(name for name in named if not any(folder.glob(name)) and not any(ROOT.glob(name)))
  assert not extra, f"README map, {entry}: names files that do not exist: {extra}"


def test_parse_map_reads_entries_and_continuations():
  lines = ["src/maxtext/", "  a/                  x.py,", "                      y.py", "docs/                 z.png"]
  assert parse_map(lines) == {"src/maxtext": "", "src/maxtext/a": "x.py, y.py", "docs": "z.png"}


def test_names_matches_whole_names_only(tmp_path):
  (tmp_path / "hf.py").touch()
  (tmp_path / "cpu").mkdir()
  assert _names(tmp_path / "hf.py", "config (hf_config, hf)")
  assert not _names(tmp_path / "hf.py", "config (hf_config, hf_layout)")
  assert _names(tmp_path / "cpu", "sources in cpu/, loaded by cpu_gemm")
  assert not _names(tmp_path / "cpu", "loaded by cpu_gemm")
