"""The CLI under faults, in a subprocess: a reader that closes stdout early, Ctrl-C during the imports, the loading
and the decode, a folder that is not a checkpoint. Each ends with a defined exit status and no traceback."""

import contextlib
import os
import pathlib
import re
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A run long enough to be interrupted: 4000 tokens of the tiny hybrid model take minutes on a 2-core CPU. JSON
# output, so the progress bar (not streamed text) shows on stderr when tokens are being generated.
LONG_RUN = [
    "configs/base.yml",
    "model_name=qwen3-next-tiny",
    "max_target_length=4096",
    "max_new_tokens=4000",
    "num_kv_blocks=300",
    "output_format=json",
]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


def _start(args, **kwargs):
  return subprocess.Popen(  # pylint: disable=consider-using-with  # the tests drive the process by hand
      [sys.executable, "-m", "maxtext.decode", *args], cwd=ROOT, env=_env(), **kwargs
  )


def test_a_reader_that_closes_stdout_early_gets_no_traceback():
  proc = _start(["--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  proc.stdout.close()  # like `| head -0`: closed before the first write
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1, err
  assert b"Traceback" not in err and b"BrokenPipeError" not in err, err


def _wait_for(proc, pattern, timeout):
  """Reads stderr until the regular expression `pattern` matches; returns what was read."""
  selector = selectors.DefaultSelector()
  selector.register(proc.stderr, selectors.EVENT_READ)
  seen = b""
  deadline = time.monotonic() + timeout
  while not re.search(pattern, seen):
    remaining = deadline - time.monotonic()
    assert remaining > 0 and proc.poll() is None, seen
    if selector.select(remaining):
      seen += os.read(proc.stderr.fileno(), 4096)
  return seen


@contextlib.contextmanager
def _killed_on_failure(proc):
  """Kills the process when the block fails (a wait that timed out), so no CLI outlives its test."""
  try:
    yield
  except BaseException:
    proc.kill()
    proc.communicate()
    raise


def _interrupt(proc, before=b""):
  """Sends SIGINT, waits for the exit; checks status 130, no traceback and the message last, on a line of its own.
  Returns (stdout, stderr)."""
  try:
    proc.send_signal(signal.SIGINT)
    out, after = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  err = (before + after).decode("utf-8", "replace")
  assert proc.returncode == 130, err
  for sign in ("Traceback", "KeyboardInterrupt", "Exception ignored"):
    assert sign not in err, err
  assert ("\n" + err).endswith("\nmaxtext-decode: interrupted\n"), repr(err[-200:])
  return out, err


def _wait_for_library(proc, fragment, timeout):
  """Waits until the process has mapped a shared library whose path holds `fragment` (it is importing it)."""
  maps = pathlib.Path(f"/proc/{proc.pid}/maps")
  deadline = time.monotonic() + timeout
  while fragment not in maps.read_text(encoding="utf-8"):
    assert time.monotonic() < deadline and proc.poll() is None, f"{fragment} never loaded"
    time.sleep(0.002)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="watches /proc/<pid>/maps (Linux)")
@pytest.mark.parametrize(
    "library, delay",
    [("numpy/_core/_multiarray_umath", 0.0), ("jaxlib/_jax", 0.0), ("jaxlib/_jax", 0.3), ("jaxlib/_jax", 1.0)],
    ids=["numpy-loading", "jax-loading", "jax-loaded-0.3s", "jax-loaded-1s"],
)
def test_ctrl_c_during_the_imports_exits_130_with_one_line(library, delay):
  # NumPy and JAX are imported by the CLI's work, after the entry point has set up its handler. JAX registers a gc
  # callback: an interrupt that lands inside it cannot be raised there and comes again just after.
  proc = _start(["configs/base.yml", "max_new_tokens=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  with _killed_on_failure(proc):
    _wait_for_library(proc, library, timeout=120)
    time.sleep(delay)
  out, err = _interrupt(proc)
  assert err == "maxtext-decode: interrupted\n" and out == b""


def _write_gguf(path, layers, width=256):
  """A random Llama GGUF (Q8_0 matrices) of `layers` layers whose tokenizer is byte-level BPE with one merge."""
  gguf = pytest.importorskip("gguf")
  tokenizers = pytest.importorskip("tokenizers")
  vocab = ["<|endoftext|>", "<s>", "</s>"] + sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()) + ["he"]
  heads, kv_heads, ff = 4, 2, 3 * width
  head_dim = width // heads
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(layers)
  writer.add_context_length(512)
  writer.add_embedding_length(width)
  writer.add_feed_forward_length(ff)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(10000.0)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(vocab)
  writer.add_token_types([3] * 3 + [1] * (len(vocab) - 3))
  writer.add_token_merges(["h e"])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  rng = np.random.default_rng(0)

  def add(name, *shape):
    array = rng.standard_normal(shape, dtype=np.float32) * 0.05
    if len(shape) == 1:
      writer.add_tensor(name, 1 + array)
    else:
      writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), raw_dtype=8)

  add("token_embd.weight", len(vocab), width)
  add("output_norm.weight", width)
  for i in range(layers):
    add(f"blk.{i}.attn_norm.weight", width)
    add(f"blk.{i}.ffn_norm.weight", width)
    add(f"blk.{i}.attn_q.weight", heads * head_dim, width)
    add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, width)
    add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, width)
    add(f"blk.{i}.attn_output.weight", width, heads * head_dim)
    add(f"blk.{i}.ffn_gate.weight", ff, width)
    add(f"blk.{i}.ffn_up.weight", ff, width)
    add(f"blk.{i}.ffn_down.weight", width, ff)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.slow
def test_ctrl_c_while_the_weights_load_ends_the_progress_bar_line_first(tmp_path):
  path = tmp_path / "model.gguf"
  _write_gguf(path, layers=128)  # 1,154 tensors: a load long enough to show a partial bar on a fast machine
  proc = _start(
      ["configs/base.yml", f"gguf_model_path={path}", "prompt_token_ids=[1, 5, 6]", "max_new_tokens=2"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
  )
  with _killed_on_failure(proc):
    before = _wait_for(proc, rb"Loading model.gguf: +[1-9][0-9]?%", timeout=300)  # part of the weights loaded
  out, err = _interrupt(proc, before)
  assert out == b""
  # The bar's line is ended, then the message; its last render is where loading stopped, before the end.
  *_, bar_line, message, end = err.split("\n")
  assert message == "maxtext-decode: interrupted" and end == ""
  done, total = map(int, re.findall(r"(\d+)/(\d+) \[", bar_line.split("\r")[-1])[-1])
  assert done < total == 2 + 9 * 128, bar_line


@pytest.mark.slow
def test_ctrl_c_mid_decode_exits_130_without_a_traceback():
  proc = _start(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  # The progress bar has counted generated tokens (its first render, "0/4000", comes before the first step).
  with _killed_on_failure(proc):
    before = _wait_for(proc, rb"[1-9][0-9]*/4000", timeout=300)
  out, _ = _interrupt(proc, before)
  assert out == b""


@pytest.mark.slow
def test_ctrl_c_mid_stream_keeps_the_text_so_far_and_says_interrupted():
  text_run = [arg for arg in LONG_RUN if arg != "output_format=json"]
  proc = _start(text_run, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  with _killed_on_failure(proc):
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    assert selector.select(300), "no text streamed"
    streamed = os.read(proc.stdout.fileno(), 4096)
  out, err = _interrupt(proc)
  assert streamed and err == "maxtext-decode: interrupted\n"
  assert len(streamed + out) < 4000 * 4  # stopped long before the 4000 tokens (at most 4 UTF-8 bytes each)


@pytest.mark.slow
def test_load_parameters_path_that_is_not_a_checkpoint_is_one_line(tmp_path):
  (tmp_path / "README").write_text("not a checkpoint", encoding="utf-8")
  proc = _start(
      ["configs/base.yml", "model_name=llama-tiny", f"load_parameters_path={tmp_path}"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 2, err
  assert out == ""
  assert err.splitlines() == [
      f"maxtext-decode: error: '{tmp_path}' is not an Orbax parameter checkpoint (it has no _METADATA file)"
  ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["gguf_model_path={folder}"], "gguf_model_path='{folder}' is a folder, not a GGUF file;"),
        (["hf_model_path={file}"], "hf_model_path='{file}' is a file, not a folder;"),
        (
            ["model_name=smollm2-135m-instruct", "hf_model_path={folder}"],
            "the command line sets hf_model_path='{folder}' and model_name=smollm2-135m-instruct sets gguf_model_path=",
        ),
    ],
)
def test_a_wrong_kind_of_path_or_a_key_from_the_model_config_is_named_in_one_line(tmp_path, args, expected):
  paths = {"folder": tmp_path, "file": tmp_path / "model.safetensors"}
  paths["file"].write_bytes(b"\x00" * 8)
  proc = _start(
      ["configs/base.yml", "prompt=Hi", *(arg.format(**paths) for arg in args)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  out, err = proc.communicate(timeout=300)
  assert (proc.returncode, out) == (2, ""), err
  (line,) = err.splitlines()
  assert line.startswith("maxtext-decode: error: " + expected.format(**paths)), line
  assert "does not exist" not in line


def test_a_run_that_cannot_fit_in_memory_is_refused_in_one_line_before_anything_is_allocated():
  # The same refusal as llama3.1-8b's 33 GB on a smaller machine, on the tiny model with a lowered limit.
  env = dict(_env(), MAXTEXT_MEMORY_LIMIT_BYTES="15000000")
  proc = subprocess.Popen(  # pylint: disable=consider-using-with  # communicate() below
      [sys.executable, "-m", "maxtext.decode", "configs/base.yml", "model_name=qwen3-next-tiny", "prompt=Hi"],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  out, err = proc.communicate(timeout=300)
  assert (proc.returncode, out) == (2, ""), err
  assert err.splitlines() == [
      "maxtext-decode: error: model_name=qwen3-next-tiny needs 21.22 MiB (parameters 3.77 MiB: float32, random, no"
      " checkpoint; KV caches 16.42 MiB; activations 1.03 MiB) but 14.31 MiB is available"
      " (MAXTEXT_MEMORY_LIMIT_BYTES); use a KV cache within the 9.50 MiB left (kv_cache_memory_bytes=9960640 or"
      " less, with a max_target_length it holds; fewer max_num_seqs for recurrent states); memory_check=false runs"
      " it anyway"
  ]
