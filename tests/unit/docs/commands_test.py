"""Every fenced block of README.md and docs/*.md is run, compared with what the program prints, or checked
statically, as BLOCKS says for each; a block BLOCKS does not name (or an entry that names no block) fails.

Commands run in a subprocess from the checkout (`maxtext-decode` as `python -m maxtext.decode`, `python` as this
interpreter, `src/` on PYTHONPATH), as documented: a path the page leaves to the reader (`/path/to/...`) is filled
in with a file the test writes, nothing else changes. A command of a real model runs when its GGUF file is in
`~/.cache/maxtext/` and is skipped naming the file otherwise. Commands that install, run a test suite or the
upstream tier, need a TPU or vLLM, or run for minutes (the benchmarks) are not run: their scripts must exist, the
flags they pass must be in the script's `--help` and the config keys they pass must load.
"""

import dataclasses
import functools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import yaml

from maxtext.configs import load_config
from maxtext.inference.prompts_file import read_prompts_file

ROOT = pathlib.Path(__file__).resolve().parents[3]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
MODELS = pathlib.Path("~/.cache/maxtext").expanduser()
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = MODELS / "gemma-3-270m-q4_k_m.gguf"

RUN = "run"  # executed in a subprocess; exit status 0 and what the page says it prints
PYTHON = "python"  # executed in a subprocess; must not raise
SAMPLE = "sample"  # printed output, compared with what the program prints
STATIC = "static"  # not run (the reason is given); its scripts, flags and keys are checked
ELSEWHERE = "elsewhere"  # run or compared by the named test
NOT_CODE = "not code"  # a diagram, a quoted signature or the code map: nothing to execute


@dataclasses.dataclass(frozen=True)
class Check:
  """How BLOCKS checks one block."""

  kind: str
  how: str  # how the block is checked, or precisely why it is not run


# (page, a substring found in that block only) -> how the block is checked.
BLOCKS: dict[tuple[str, str], Check] = {
    ("README.md", "python3 -m venv .venv"): Check(
        STATIC,
        "creates a venv and pip-installs (not run): the pinned torch comes first (readme_test.py); its last two"
        " steps, the fetch and the decode, run in test_the_readme_example_model_commands_print_what_the_page_says",
    ),
    ("README.md", "--model gemma3-270m &&"): Check(
        RUN, "fetch (verifies the present file, no download) then decode; stdout is the README's quoted answer"
    ),
    ("README.md", "--cov-fail-under=90"): Check(ELSEWHERE, "the whole suite: readme_test.py checks it is CI's command"),
    ("README.md", "bash scripts/upstream_tier.sh"): Check(
        STATIC, "the upstream tier (minutes, its own venv): CI runs it (readme_test.py); here `bash -n` on the script"
    ),
    ("README.md", '"not slow and not hf"'): Check(
        ELSEWHERE, "a test-suite run: readme_test.py checks its options and markers"
    ),
    ("README.md", 'prompt="Name a color."'): Check(RUN, "each line in a subprocess; prompts_file= is README's sample"),
    ("README.md", '{"prompt_token_ids": [1, 4093, 198]}'): Check(
        RUN, "read by read_prompts_file (two prompts: text and ids) and decoded as the prompts_file of the line above"
    ),
    ("README.md", "kv_cache_layout=hybrid hybrid_kv_cache=True"): Check(
        SAMPLE, "cli_docs_test.py::test_the_readme_dry_run_sample_is_what_the_program_prints; its command runs here"
    ),
    ("README.md", "hf_model_path=/path/to/hf_model prompt="): Check(
        RUN, "a tiny Qwen3 folder written by transformers as /path/to/hf_model (hf extra)"
    ),
    ("README.md", "gguf_model_path=/path/to/model.gguf"): Check(RUN, "the example model's file as /path/to/model.gguf"),
    ("README.md", "scripts/convert_hf_checkpoint.py --hf_model_path"): Check(
        RUN, "both lines, /path/to/hf_model a tiny Qwen3 folder (hf extra), /path/to/converted a temporary folder"
    ),
    ("README.md", "from maxtext.inference import LLM"): Check(
        PYTHON, "as it stands (it needs the example model); its output ends with a newline"
    ),
    ("README.md", "cfg.layer_types"): Check(PYTHON, "as it stands"),
    ("README.md", "src/maxtext/\n  configs/"): Check(ELSEWHERE, "the code map: readme_map_test.py"),
    ("docs/architecture.md", "+->  integration/vllm"): Check(NOT_CODE, "a diagram of the packages' imports"),
    ("docs/architecture.md", "class RunningMean(Mixer)"): Check(
        PYTHON,
        "defined with the imports it needs, then compared with tests/integration/toy_mixer_test.py's RunningMean"
        " (which that test decodes with): same kind, cache kind, parameter name, methods, cache spec and declarations",
    ),
    ("docs/architecture.md", "configs/families/mistral.py"): Check(
        PYTHON, "run with the imports a family module has; FAMILY is a Family whose layer_types maps a window"
    ),
    ("docs/architecture.md", "configs/models/mistral-tiny.yml"): Check(
        STATIC, "a family this package does not have: its keys are base.yml's and its layer kinds known"
    ),
    ("docs/architecture.md", "class NPZFile(CheckpointSource)"): Check(
        PYTHON, "defined with its imports; every method it defines is one of CheckpointSource's"
    ),
    ("docs/benchmarks.md", "--vllm-python V/bin/python"): Check(
        STATIC, "a benchmark of minutes needing a vLLM venv: script and flags checked"
    ),
    ("docs/benchmarks.md", "--models smollm2 --peers maxtext llamacpp"): Check(
        STATIC, "builds llama.cpp and benchmarks for minutes: scripts and flags checked"
    ),
    ("docs/benchmarks.md", "smollm2     maxtext              8"): Check(SAMPLE, "header against a --quick run"),
    ("docs/benchmarks.md", "gemma3      maxtext          1"): Check(SAMPLE, "header against a --quick run"),
    ("docs/benchmarks.md", "python scripts/benchmark_moe.py"): Check(STATIC, "minutes: script checked"),
    ("docs/benchmarks.md", "8 MoE layers"): Check(SAMPLE, "title and header against a --quick run"),
    ("docs/benchmarks.md", "benchmark_remap.py --repeats 5"): Check(STATIC, "minutes: script and flags checked"),
    ("docs/benchmarks.md", "backend: cpu, 5 timed steps"): Check(SAMPLE, "title and header against a --quick run"),
    ("docs/benchmarks.md", "benchmark_metadata.py --repeats 5"): Check(STATIC, "minutes: script and flags checked"),
    ("docs/benchmarks.md", "24 layers (5 sliding : 1 full)"): Check(SAMPLE, "title and header against --quick"),
    ("docs/benchmarks.md", "benchmark_memory.py --configs"): Check(STATIC, "minutes: script and flags checked"),
    ("docs/benchmarks.md", "block_size 16, budget"): Check(SAMPLE, "title and header against a --quick run"),
    ("docs/benchmarks.md", "benchmark_allocator.py --plot"): Check(STATIC, "minutes: script and flags checked"),
    ("docs/benchmarks.md", "greedy requests of context"): Check(SAMPLE, "title and header against a --quick run"),
    ("docs/benchmarks.md", "python scripts/benchmark_prefix_caching.py"): Check(STATIC, "minutes: script checked"),
    ("docs/benchmarks.md", "8 requests sharing"): Check(SAMPLE, "title and header against a --quick run"),
    ("docs/benchmarks.md", "gemma3-270m llamacpp           [15, 1, 53]"): Check(SAMPLE, "header against a --quick run"),
    ("docs/benchmarks.md", "--batches 1 --repeats 1"): Check(STATIC, "minutes on two real models: flags checked"),
    ("docs/benchmarks.md", "smollm2     maxtext:int8w      [64, 3, 4]"): Check(SAMPLE, "header against a --quick run"),
    ("docs/benchmarks.md", "scripts/benchmark_startup.py [--model"): Check(
        STATIC, "builds llama.cpp and starts many processes: scripts and flags checked"
    ),
    ("docs/benchmarks.md", "maxtext-decode                          0.03     1.67"): Check(
        SAMPLE, "header against a --quick run (smollm2)"
    ),
    ("docs/benchmarks.md", "gemma3-270m compact: warm start"): Check(SAMPLE, "header against a --quick run"),
    ("docs/runner-contract.md", "model_fn(state_leaves"): Check(
        NOT_CODE, "tpu-inference's call of the model, quoted; the upstream tier makes that call"
    ),
    ("docs/serving.md", "python3.12 -m venv ~/serve"): Check(
        STATIC, "installs vllm-tpu on a TPU VM (not run); its entry-point line runs here and names the plugin"
    ),
    ("docs/serving.md", "patch -p1"): Check(
        ELSEWHERE, "kv_cache_spec_patch_test.py applies the patch to the tpu-inference wheel with patch --dry-run"
    ),
    ("docs/serving.md", "vllm serve /models/Qwen3.5-35B-A3B"): Check(
        STATIC, "needs a TPU, vLLM and a 35B checkpoint: its maxtext_config keys load"
    ),
    ("docs/serving.md", "from openai import OpenAI"): Check(
        ELSEWHERE, "tests/upstream/serve_test.py runs it verbatim against a vllm serve on the CPU"
    ),
    ("docs/serving.md", 'vllm serve "$MODEL"'): Check(
        ELSEWHERE, "tests/upstream/serve_test.py runs it with $MODEL and $PORT filled in"
    ),
    ("docs/serving.md", "scripts/tpu_report.py --json"): Check(
        STATIC, "builds the upstream venv and compiles for TPU for about 14 minutes: scripts and flags checked"
    ),
}

_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)


def blocks(page: str) -> list[tuple[str, str]]:
  """The fenced blocks of `page` as (language, body), their indentation removed."""
  text = (ROOT / page).read_text(encoding="utf-8")
  return [(m.group(2), textwrap.dedent(m.group(3))) for m in _FENCE.finditer(text)]


def block(page: str, key: str) -> str:
  """The one block of `page` that holds `key`."""
  (body,) = [body for _, body in blocks(page) if key in body]
  return body


def test_the_block_reader_finds_indented_and_bare_blocks():
  text = "a\n```bash\nx y\n```\n- item\n\n  ```\n  {1}\n  ```\n"
  assert [(m.group(2), textwrap.dedent(m.group(3))) for m in _FENCE.finditer(text)] == [("bash", "x y\n"), ("", "{1}\n")]


def test_every_block_has_exactly_one_entry_and_every_entry_one_block():
  unlisted, ambiguous = [], []
  for page in PAGES:
    for number, (_, body) in enumerate(blocks(page)):
      keys = [key for p, key in BLOCKS if p == page and key in body]
      if not keys:
        unlisted.append(f"{page} block {number}: {body.splitlines()[0][:80]!r}")
      elif len(keys) > 1:
        ambiguous.append(f"{page} block {number}: matched by {keys}")
  assert not unlisted, f"blocks BLOCKS does not say how to check (add an entry): {unlisted}"
  assert not ambiguous, ambiguous
  for page, key in BLOCKS:
    found = sum(key in body for _, body in blocks(page))
    assert found == 1, f"BLOCKS entry ({page!r}, {key!r}) must name exactly one block; it is in {found}"
  assert {check.kind for check in BLOCKS.values()} <= {RUN, PYTHON, SAMPLE, STATIC, ELSEWHERE, NOT_CODE}


# ---------------------------------------------------------------------------------------------------------------
# Running documented commands.

_PROGRAMS = {
    "maxtext-decode": [sys.executable, "-m", "maxtext.decode"],
    ".venv/bin/maxtext-decode": [sys.executable, "-m", "maxtext.decode"],
    "python": [sys.executable],
    ".venv/bin/python": [sys.executable],
}


def commands(body: str) -> list[str]:
  """The shell commands of a block: continuation lines joined, `&&` chains split."""
  lines, pending = [], ""
  for line in body.replace("\\\n", " ").splitlines():
    pending = f"{pending} {line.strip()}" if pending else line.strip()
    try:
      shlex.split(pending, comments=True)
    except ValueError:  # a quote continues on the next line
      continue
    if pending:
      lines.append(pending)
    pending = ""
  assert not pending, f"an unclosed quote in {body!r}"
  return [step.strip() for line in lines for step in line.split(" && ")]


def run(command: str, fill: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
  """Runs a documented command from the checkout, with the reader's placeholders in `fill` replaced."""
  for placeholder, value in (fill or {}).items():
    assert placeholder in command, f"{placeholder!r} is not in the documented command {command!r}"
    command = command.replace(placeholder, value)
  words = shlex.split(command, comments=True)
  assert words[0] in _PROGRAMS, f"the documented command {command!r} starts with an unknown program {words[0]!r}"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
  done = subprocess.run(
      _PROGRAMS[words[0]] + words[1:], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
  )
  assert done.returncode == 0, f"`{command}` exited {done.returncode}; stderr ends:\n{done.stderr[-3000:]}"
  return done


def _needs(path: pathlib.Path) -> None:
  if not path.is_file():
    pytest.skip(f"needs {path} (scripts/fetch_example_model.py fetches it)")


def _quoted_answer(after: str) -> str:
  """The README's `It prints `...`` after the block holding `after` (a quote may span lines)."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  match = re.compile(r"It prints `([^`]*)`").search(text, text.index(after))
  assert match, f"README.md says no `It prints ...` after the block holding {after!r}"
  return match.group(1).replace("\n", " ")


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, gguf",
    [("python3 -m venv .venv", SMOLLM2), ("--model gemma3-270m &&", GEMMA3)],
    ids=["smollm2", "gemma3-270m"],
)
def test_the_readme_example_model_commands_print_what_the_page_says(key, gguf):
  _needs(gguf)
  steps = commands(block("README.md", key))
  fetch, decode = [step for step in steps if "pip " not in step and "venv" not in step.split()[:3]]
  assert run(fetch).stdout.strip() == str(gguf), f"`{fetch}` must print the path of {gguf}"
  answer = run(decode).stdout
  assert answer.rstrip("\n") == _quoted_answer(key), f"`{decode}` printed {answer!r}; README says otherwise"


README_DECODE = commands(block("README.md", 'prompt="Name a color."'))
_REAL = ("smollm2-135m-instruct",)


@pytest.mark.parametrize("command", README_DECODE, ids=[c.split("model_name=")[1].split()[0] for c in README_DECODE])
def test_the_readme_decode_lines_run(command, tmp_path, request):
  if any(f"model_name={name}" in command for name in _REAL):
    request.applymarker(pytest.mark.slow)
    _needs(SMOLLM2)
  fill = {}
  if "prompts_file=questions.txt" in command:
    questions = tmp_path / "questions.txt"
    questions.write_text(block("README.md", '{"prompt_token_ids": [1, 4093, 198]}'), encoding="utf-8")
    fill["prompts_file=questions.txt"] = f"prompts_file={questions}"
  out = run(command, fill).stdout
  if "output_format=json" in command:
    (req,) = json.loads(out)["requests"]
    assert len(req["output_token_ids"]) == 8 and len(req["logprobs"][0]["top"]) == 2, req
  elif "dry_run=true" in command:
    sample = block("README.md", "kv_cache_layout=hybrid hybrid_kv_cache=True")
    assert out.splitlines()[0] == sample.splitlines()[0], out
  elif fill:
    assert re.fullmatch(r"=== prompt 0 \(line 1\) ===\n.+\n=== prompt 1 \(line 2\) ===\n(.*\n)+", out), out
  else:
    assert out.strip(), f"`{command}` printed nothing on stdout"


def test_the_readme_prompts_file_sample_is_one_text_and_one_ids_prompt(tmp_path):
  path = tmp_path / "questions.jsonl"
  path.write_text(block("README.md", '{"prompt_token_ids": [1, 4093, 198]}'), encoding="utf-8")
  prompts = read_prompts_file(str(path))
  assert [(p.line, p.prompt) for p in prompts] == [(1, "What is the capital of France?"), (2, [1, 4093, 198])]


def _write_hf_folder(folder: pathlib.Path) -> pathlib.Path:
  """A tiny random Qwen3 saved by transformers, with a WordLevel tokenizer.json over its 512 ids."""
  # pylint: disable=import-outside-toplevel  # torch, transformers and tokenizers are the optional hf extra
  import torch
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  config = transformers.AutoConfig.for_model(
      "qwen3",
      vocab_size=512,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      tie_word_embeddings=True,
      bos_token_id=1,
      eos_token_id=2,
  )
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(config).save_pretrained(str(folder))
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder


@pytest.mark.hf
@pytest.mark.slow
def test_the_readme_checkpoint_commands_run(tmp_path):
  hf_folder = str(_write_hf_folder(tmp_path / "hf_model"))
  fill = {"/path/to/hf_model": hf_folder, "/path/to/converted": str(tmp_path / "converted")}
  (hf_line,) = commands(block("README.md", "hf_model_path=/path/to/hf_model prompt="))
  assert run(hf_line, {"/path/to/hf_model": hf_folder}).stdout.strip()
  convert, decode = commands(block("README.md", "scripts/convert_hf_checkpoint.py --hf_model_path"))
  run(convert, fill)
  assert (tmp_path / "converted" / "maxtext_model.yml").is_file()
  assert run(decode, {"/path/to/converted": fill["/path/to/converted"]}).stdout.strip()


@pytest.mark.slow
def test_the_readme_gguf_command_runs():
  _needs(SMOLLM2)
  (line,) = commands(block("README.md", "gguf_model_path=/path/to/model.gguf"))
  assert run(line, {"/path/to/model.gguf": str(SMOLLM2)}).stdout.strip()


# ---------------------------------------------------------------------------------------------------------------
# Python blocks.


def run_python(source: str, name: str) -> str:
  """Runs `source` in a fresh interpreter from the checkout; returns its stdout."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
  done = subprocess.run(
      [sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert done.returncode == 0, f"{name} raised; stderr ends:\n{done.stderr[-3000:]}"
  return done.stdout


@pytest.mark.slow
def test_the_readme_api_snippet_runs_and_ends_its_output_with_a_newline():
  _needs(SMOLLM2)
  out = run_python(block("README.md", "from maxtext.inference import LLM"), "README.md's Python API snippet")
  assert out.endswith("\n") and "Paris" in out.splitlines()[-2], out[-300:]


def test_the_readme_config_snippet_runs():
  source = block("README.md", "cfg.layer_types")
  run_python(source + "assert cfg.layer_types, cfg.layer_types\n", "README.md's load_config snippet")


_MIXER_PRELUDE = """
import jax.numpy as jnp
from maxtext.configs import load_config
from maxtext.kv_cache.cache_spec import RecurrentSpec
from maxtext.layers.declarations import ParamDecl
from maxtext.layers.linears import DenseGeneral
from maxtext.layers.mixer import Mixer
register_mixer = lambda cls: cls  # the test module registers the kind; registering it twice is an error
"""

_MIXER_COMPARE = """
from integration import toy_mixer_test
test = toy_mixer_test.RunningMean
assert test.layer_types == RunningMean.layer_types, (test.layer_types, RunningMean.layer_types)
assert (test.cache_kind, test.param_name) == (RunningMean.cache_kind, RunningMean.param_name)
methods = lambda cls: sorted(n for n, v in vars(cls).items() if callable(v) or isinstance(v, classmethod))
assert methods(test) == methods(RunningMean), (methods(test), methods(RunningMean))
cfg = load_config(["configs/base.yml", "model_name=llama-tiny",
                   'layer_types=["running_mean", "full_attention", "running_mean", "full_attention"]',
                   "base_num_decoder_layers=4"])
assert test.cache_spec(cfg, 0) == RunningMean.cache_spec(cfg, 0), (test.cache_spec(cfg, 0), RunningMean.cache_spec(cfg, 0))
assert test.declare(cfg, 0) == RunningMean.declare(cfg, 0)
"""


def test_the_architecture_mixer_example_is_the_tested_one():
  run_python(
      _MIXER_PRELUDE + block("docs/architecture.md", "class RunningMean(Mixer)") + _MIXER_COMPARE,
      "docs/architecture.md's RunningMean",
  )


_FAMILY_PRELUDE = """
from maxtext.configs.families.family import Family, HFMapping
from maxtext.configs.families.hf_fields import given_layer_types
from maxtext.configs.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION
"""

_FAMILY_CHECK = """
from maxtext.configs.families.hf_fields import HFFields
defaults = FAMILY.hf.model_types["mistral"]
assert isinstance(FAMILY, Family) and FAMILY.name == "mistral"
windowed = HFFields({"sliding_window": 8}, "mistral", defaults)
assert FAMILY.hf.layer_types(windowed, 2) == [SLIDING_ATTENTION] * 2, FAMILY.hf.layer_types(windowed, 2)
unwindowed = HFFields({"sliding_window": None}, "mistral", defaults)
assert FAMILY.hf.layer_types(unwindowed, 2) == [FULL_ATTENTION] * 2, FAMILY.hf.layer_types(unwindowed, 2)
"""


def test_the_architecture_family_example_builds_a_family():
  run_python(
      _FAMILY_PRELUDE + block("docs/architecture.md", "configs/families/mistral.py") + _FAMILY_CHECK,
      "docs/architecture.md's mistral family",
  )


def test_the_architecture_model_yaml_example_names_known_keys_and_kinds():
  from maxtext.configs import layer_kinds  # pylint: disable=import-outside-toplevel

  keys = yaml.safe_load(block("docs/architecture.md", "configs/models/mistral-tiny.yml"))
  base = yaml.safe_load((ROOT / "configs" / "base.yml").read_text(encoding="utf-8"))
  assert set(keys) <= set(base), f"docs/architecture.md's mistral-tiny.yml: keys not in base.yml {set(keys) - set(base)}"
  known = {value for name, value in vars(layer_kinds).items() if name.isupper() and isinstance(value, str)}
  assert set(keys["layer_types"]) <= known, (keys["layer_types"], known)


_SOURCE_CHECK = """
assert issubclass(NPZFile, CheckpointSource) and NPZFile.key == "npz_params_path"
extra = sorted(n for n, v in vars(NPZFile).items() if callable(v) and not hasattr(CheckpointSource, n))
assert not extra, f"NPZFile defines methods CheckpointSource does not have: {extra}"
"""


def test_the_architecture_checkpoint_example_implements_the_interface():
  prelude = (
      "import numpy as np\nfrom maxtext.checkpoint.source import CheckpointSource\n"
      "from maxtext.models import abstract_model, assign_params\n"
  )
  run_python(
      prelude + block("docs/architecture.md", "class NPZFile(CheckpointSource)") + _SOURCE_CHECK,
      "docs/architecture.md's NPZFile",
  )


def test_the_serving_entry_point_line_names_the_plugin():
  (line,) = [c for c in commands(block("docs/serving.md", "python3.12 -m venv ~/serve")) if c.startswith("python -c")]
  out = run(line).stdout
  text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
  quoted = re.search(r"The last line should list `([^`]*)`", text).group(1).replace("\n", " ")
  assert quoted in out and "value='maxtext.integration.vllm.plugin:register'" in quoted, (quoted, out)


# ---------------------------------------------------------------------------------------------------------------
# Commands not run: their scripts, flags and config keys.


@functools.cache
def _help(script: str) -> str:
  return run(f"python {script} --help", timeout=120).stdout


STATIC_COMMANDS = [
    (page, command)
    for (page, key), check in BLOCKS.items()
    if check.kind == STATIC and page != "docs/architecture.md"
    for command in commands(block(page, key))
]


@pytest.mark.parametrize("page, command", STATIC_COMMANDS, ids=[f"{p}:{c[:40]}" for p, c in STATIC_COMMANDS])
def test_a_command_not_run_names_existing_scripts_flags_and_keys(page, command):
  words = shlex.split(command.replace("$(", " ").replace(")", " "), comments=True)
  scripts = [w for w in words if re.fullmatch(r"scripts/\w+\.(py|sh)", w)]
  for script in scripts:
    assert (ROOT / script).is_file(), f"{page}: `{command}` names {script}, which does not exist"
    if script.endswith(".sh"):
      subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
    else:
      flags = set(re.findall(r"(?<![\w-])(--[\w-]+)", " ".join(words)))
      missing = sorted(flag for flag in flags if not re.search(rf"(?<![\w-]){flag}(?![\w-])", _help(script)))
      assert not missing, f"{page}: `{command}` passes {missing}, which `{script} --help` does not list"
  if words[:2] == ["vllm", "serve"]:
    config = json.loads(re.search(r"--additional-config '([^']*)'", command).group(1))["maxtext_config"]
    config.pop("hf_model_path", None)  # the checkpoint folder of the page's machine
    load_config([str(ROOT / "configs" / "base.yml"), "model_name=llama-tiny"], **config)
  elif words[0].endswith("maxtext-decode"):
    load_config([str(ROOT / words[1]), *words[2:]])
  elif not scripts:  # python -c: serving.md's entry-point line, run by test_the_serving_entry_point_line_names_the_plugin
    assert words[0] in {
        "python3",
        "python3.12",
        "source",
        "pip",
        ".venv/bin/pip",
        "python",
    }, f"{page}: unchecked `{command}`"


# ---------------------------------------------------------------------------------------------------------------
# Benchmark tables: the printed title and columns against what the script prints in --quick mode.

_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?")

# sample key -> (script, --quick arguments, whether the title line is compared)
TABLES = {
    "smollm2     maxtext              8": ("benchmark_decode.py", "--peers maxtext --models llama --batches 1", False),
    "gemma3      maxtext          1": ("benchmark_decode.py", "--peers maxtext --models llama --batches 1", False),
    "gemma3-270m llamacpp           [15, 1, 53]": (
        "benchmark_decode.py",
        "--peers maxtext --models llama --batches 1",
        False,
    ),
    "smollm2     maxtext:int8w      [64, 3, 4]": (
        "benchmark_decode.py",
        "--peers maxtext --models llama --batches 1",
        False,
    ),
    "8 MoE layers": ("benchmark_moe.py", "", True),
    "backend: cpu, 5 timed steps": ("benchmark_remap.py", "", True),
    "24 layers (5 sliding : 1 full)": ("benchmark_metadata.py", "", True),
    "block_size 16, budget": ("benchmark_memory.py", "--configs gemma3 --contexts 48 --throughput-max-context 0", True),
    "greedy requests of context": ("benchmark_allocator.py", "--models gemma3", True),
    "8 requests sharing": ("benchmark_prefix_caching.py", "--models qwen3-next-tiny", True),
    "maxtext-decode                          0.03     1.67": ("benchmark_startup.py", "", False),
    "gemma3-270m compact: warm start": ("benchmark_startup.py", "", False),
}


def table_header(text: str) -> list[str]:
  """A table's column names: the line above its first rule of dashes, else the line starting with `peer`."""
  lines = text.splitlines()
  for above, line in zip(lines, lines[1:]):
    if re.fullmatch(r"-{10,}", line):
      return above.split()
  return next(line.split() for line in lines if line.startswith("peer "))


def title_pattern(title: str) -> re.Pattern:
  """The title with every number a placeholder for any number."""
  return re.compile("".join(re.escape(part) if i % 2 == 0 else _NUMBER.pattern for i, part in enumerate(_split(title))))


def _split(title: str) -> list[str]:
  parts, at = [], 0
  for match in _NUMBER.finditer(title):
    parts += [title[at : match.start()], match.group()]
    at = match.end()
  return parts + [title[at:]]


def test_the_table_matchers():
  assert title_pattern("8 layers, 1.5 ms").fullmatch("2 layers, 0.25 ms")
  assert not title_pattern("8 layers, 1.5 ms").fullmatch("2 blocks, 0.25 ms")
  assert table_header("title\na  b c\n----------\n1 2 3\n") == ["a", "b", "c"]
  assert table_header("peer  x y\nz 1 2\n") == ["peer", "x", "y"]


def test_every_benchmark_table_is_compared():
  samples = {key for (page, key), check in BLOCKS.items() if page == "docs/benchmarks.md" and check.kind == SAMPLE}
  assert samples == set(TABLES), samples ^ set(TABLES)


@functools.cache
def _quick(script: str, args: str) -> str:
  return run(f"python scripts/{script} --quick {args}", timeout=600).stdout


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(TABLES))
def test_a_benchmark_table_has_the_columns_and_title_the_script_prints(key):
  script, args, with_title = TABLES[key]
  sample = block("docs/benchmarks.md", key)
  out = _quick(script, args)
  assert table_header(sample) == table_header(
      out
  ), f"docs/benchmarks.md's table {key!r} has columns {table_header(sample)}; {script} prints {table_header(out)}"
  if with_title:
    title = out.splitlines()[0]
    assert title_pattern(sample.splitlines()[0]).fullmatch(
        title
    ), f"docs/benchmarks.md's table {key!r} starts {sample.splitlines()[0]!r}; {script} prints {title!r}"
