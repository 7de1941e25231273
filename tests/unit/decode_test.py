"""In-process tests of the decode CLI (`maxtext.decode.main`): output formats, the dry run, sampling keys, errors.

The token reference is independent of the runner: the same random model built directly from the config (the
adapter's dummy initialisation: `Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(init_seed)))`), run
greedily with full-sequence forwards. tests/integration/cli_test.py runs the same CLI in a subprocess.
"""

import json
import pathlib
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import decode, decode_run
from maxtext.checkpoint import model_loader
from maxtext.configs import load_config
from maxtext.inference import CompletionOutput, Logprob, RequestOutput
from maxtext.models import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = str(ROOT / "configs" / "base.yml")
EOS = 2
PAD_TO = 32
# The base config's tiny Llama with a 259-id vocabulary: every non-special id is a byte, so text is not empty.
RUN = ["vocab_size=259", "max_target_length=32", "num_kv_blocks=16", "block_size=8", "max_num_seqs=2"]


def _dense_greedy(cfg, prompt, max_tokens):
  """(greedy tokens, float64 log-softmax rows) of the config's dummy-initialised model, stopping at eos."""
  model = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(cfg.init_seed)))
  forward = jax.jit(lambda tokens: model(tokens[None])[0])
  tokens, out, rows = list(prompt), [], []
  for _ in range(max_tokens):
    padded = jnp.asarray(tokens + [0] * (PAD_TO - len(tokens)), jnp.int32)
    logits = np.asarray(forward(padded)[len(tokens) - 1], np.float64)
    shifted = logits - logits.max()
    rows.append(shifted - np.log(np.exp(shifted).sum()))
    out.append(int(np.argmax(logits)))
    tokens.append(out[-1])
    if out[-1] == EOS:
      break
  return out, rows


def _byte_text(ids):
  return bytes(t - 3 for t in ids if 3 <= t < 259).decode("utf-8", errors="replace")


def _one_error_line(err):
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("maxtext-decode: error: ")
  return lines[0]


@pytest.fixture(name="reference", scope="module")
def fixture_reference():
  """Greedy tokens and logprob rows of the RUN model for the prompt "I love" (bos + bytes), 5 tokens."""
  cfg = load_config([BASE] + RUN)
  prompt = [1] + [b + 3 for b in b"I love"]
  return prompt, *_dense_greedy(cfg, prompt, 5)


def test_json_output_is_one_object_with_tokens_logprobs_and_stats(capsys, reference):
  prompt, expected, rows = reference
  status = decode.main([BASE] + RUN + ["prompt=I love", "max_new_tokens=5", "output_format=json", "logprobs=2"])
  captured = capsys.readouterr()
  assert status == 0
  assert captured.out.endswith("\n") and captured.out.count("\n") == 1
  doc = json.loads(captured.out)
  assert set(doc) == {"requests", "stats"}
  (request,) = doc["requests"]
  assert request["prompt_token_ids"] == prompt
  assert request["output_token_ids"] == expected
  assert request["finish_reason"] == ("stop" if expected[-1] == EOS else "length")
  if request["finish_reason"] == "length":
    assert len(expected) == 5
  assert request["text"] == _byte_text(expected) and request["text"]
  assert [lp["token_id"] for lp in request["logprobs"]] == expected
  for lp, token, row in zip(request["logprobs"], expected, rows):
    np.testing.assert_allclose(lp["logprob"], row[token], atol=1e-4)
    assert [t for t, _ in lp["top"]] == np.argsort(-row, kind="stable")[:2].tolist()
  stats = doc["stats"]
  assert stats["generated_tokens"] == len(expected) and stats["prompt_tokens"] == len(prompt)
  # Two compiled steps: the prompt's token bucket, then the one-token decode bucket (min_token_bucket=1).
  assert stats["steps"] == len(expected) and stats["step_traces"] == 2
  assert "generating" in captured.err  # the progress bar goes to stderr, never into the JSON


def test_text_output_prints_the_completion_and_the_base_yml_is_optional(capsys, reference):
  _, expected, _ = reference
  assert decode.main(RUN + ["prompt=I love", "max_new_tokens=5"]) == 0
  assert capsys.readouterr().out == _byte_text(expected) + "\n"


def test_prompt_token_ids_override_the_prompt(capsys):
  cfg = load_config([BASE] + RUN)
  expected, _ = _dense_greedy(cfg, [7, 8, 9], 3)
  args = [BASE] + RUN + ["prompt=ignored", "prompt_token_ids=[7, 8, 9]", "max_new_tokens=3", "output_format=json"]
  assert decode.main(args) == 0
  (request,) = json.loads(capsys.readouterr().out)["requests"]
  assert request["prompt_token_ids"] == [7, 8, 9]
  assert request["output_token_ids"] == expected
  assert request["logprobs"] == []


def test_dry_run_prints_what_the_cache_holds_with_the_hybrid_allocator_on_and_off(capsys):
  # gemma3-tiny: layers s s f s s f (window 8): groups [0, 3], [1, 4], [2, 5] sharing 2 arrays; a block is
  # (16, 4 packed heads, 1, 128) float32 = 32768 bytes per array: 65536 bytes on (2 arrays), 196608 off (6).
  args = [BASE, "model_name=gemma3-tiny", "max_target_length=64", f"kv_cache_memory_bytes={65536 * 25}", "dry_run=true"]
  assert decode.main(args) == 0
  out = capsys.readouterr().out
  assert "hybrid_kv_cache=true: 25 blocks of 65536 bytes (24 usable)" in out
  # A 64-token request keeps 4 full-attention blocks and, in each sliding group, the one block keys 56..63 are in.
  assert "group 0 (attention, sliding window 8, block_size 16): 1 blocks a request (16 tokens kept)" in out
  assert "total: 6 blocks a request; 4 concurrent requests (256 tokens of context)" in out
  assert "hybrid_kv_cache=false: 8 blocks of 196608 bytes (7 usable)" in out
  assert "total: 4 blocks a request; 1 concurrent requests (64 tokens of context)" in out
  assert "hybrid on admits 4.00x the requests of off" in out


def test_dry_run_prints_every_layer_slot_and_the_total_without_running(capsys):
  assert decode.main([BASE, "model_name=qwen3-next-tiny", "kv_cache_layout=shuffled", "dry_run=true"]) == 0
  captured = capsys.readouterr()
  assert "generating" not in captured.err
  lines = captured.out.splitlines()
  slots = [line for line in lines if line.startswith("kv_caches[")]
  assert len(slots) == 8  # qwen3-next-tiny: 8 layers, no KV sharing
  for i in range(8):
    assert sum(f"layer.{i} " in line for line in slots) == 1, f"layer.{i}"
  total = [line for line in lines if line.startswith("total:")]
  assert len(total) == 1
  slot_bytes = [int(re.search(r"= (\d+) bytes$", line).group(1)) for line in slots]
  assert total[0] == f"total: {sum(slot_bytes)} bytes"
  # The hybrid allocator's order is not the layer order under a shuffled layout.
  assert [int(re.search(r"layer\.(\d+)", line).group(1)) for line in slots] != list(range(8))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_exits_0(capsys, flag):
  assert decode.main([flag]) == 0
  out = capsys.readouterr().out
  assert out.startswith(decode.USAGE) and "output_format=json" in out


@pytest.mark.parametrize("argv", [[], None])
def test_no_argument_prints_the_usage_on_stderr_and_exits_2(capsys, monkeypatch, argv):
  monkeypatch.setattr(sys, "argv", ["maxtext-decode"])  # main(None) reads the program's own arguments

  def no_run(*args):
    raise AssertionError(f"nothing must be decoded: run{args}")

  monkeypatch.setattr(decode, "run", no_run)
  assert decode.main(argv) == 2
  captured = capsys.readouterr()
  assert captured.err == decode.USAGE + "\n" and captured.out == ""


@pytest.mark.parametrize(
    "args, message",
    [
        ([BASE, "foo=1"], r"unknown config key 'foo' \(command line\)"),
        ([BASE, "max_new_tokens=abc"], r"max_new_tokens='abc' \(command line\): must be an integer"),
        ([BASE, "kv_cache_layout=zigzag"], r"kv_cache_layout='zigzag': must be one of layer, hybrid, shuffled"),
        ([BASE, "hf_model_path=/nonexistent"], r"Hugging Face model folder '/nonexistent' does not exist"),
        ([BASE, "tokenizer_path=/nonexistent"], r"tokenizer path /nonexistent does not exist"),
        (["/nonexistent/base.yml"], r"config file '/nonexistent/base.yml' does not exist"),
        ([BASE, "max_target_length=4"], r"the prompt has 10 tokens but must be shorter than max_target_length=4"),
        ([BASE, "prompt="], r"prompt is empty: set prompt=\.\.\. or prompt_token_ids=\[\.\.\.\]"),
        ([BASE, "max_new_tokens=-1"], r"max_new_tokens=-1: must be >= 0 \(0 = until eos, within max_target_length\)"),
        ([BASE, "kernel_backend=tpu_inference"], r"kernel_backend=tpu_inference needs the tpu-inference package"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, message):
  # tpu-inference hidden: where it is installed (the upstream tier's venv), this is the run without it.
  with mock.patch.dict(sys.modules, {"tpu_inference": None}):
    assert decode.main(args) == 2
  captured = capsys.readouterr()
  assert re.search(message, _one_error_line(captured.err)), captured.err
  assert captured.out == ""


@pytest.mark.parametrize(
    "keys, expected",
    [
        (
            {"decode_sampling_top_k": 0, "decode_sampling_nucleus_p": 0.0, "logprobs": 0},
            {"top_k": -1, "top_p": 1.0, "logprobs": None},
        ),
        (
            {"decode_sampling_top_k": -3, "decode_sampling_nucleus_p": -0.5, "logprobs": 0},
            {"top_k": -1, "top_p": 1.0, "logprobs": None},
        ),
        (
            {"decode_sampling_top_k": 5, "decode_sampling_nucleus_p": 0.9, "logprobs": 3},
            {"top_k": 5, "top_p": 0.9, "logprobs": 3},
        ),
        (
            {"decode_sampling_top_k": 1, "decode_sampling_nucleus_p": 1.0, "logprobs": 1},
            {"top_k": 1, "top_p": 1.0, "logprobs": 1},
        ),
    ],
)
def test_sampling_params_from_config_maps_the_off_values(keys, expected):
  cfg = load_config(max_new_tokens=7, decode_sampling_temperature=0.8, seed=11, **keys)
  params = decode_run.sampling_params_from_config(cfg)
  assert (params.max_tokens, params.temperature, params.seed) == (7, 0.8, 11)
  assert (params.top_k, params.top_p, params.logprobs) == (expected["top_k"], expected["top_p"], expected["logprobs"])


def test_max_new_tokens_0_is_max_target_length():
  assert decode_run.sampling_params_from_config(load_config(max_target_length=77)).max_tokens == 77  # base.yml: 0
  assert decode_run.sampling_params_from_config(load_config(max_target_length=77, max_new_tokens=5)).max_tokens == 5


def test_outputs_to_json_writes_every_request_and_the_stats():
  with_lp = CompletionOutput(
      index=0,
      text="hi",
      token_ids=[107, 108],
      cumulative_logprob=-2.5,
      logprobs=[
          {107: Logprob(-0.5, 1), 9: Logprob(-1.25, 2)},
          {108: Logprob(-2.0, 3), 4: Logprob(-1.0, 1), 5: Logprob(-1.5, 2)},  # the sampled token is not in the top 2
      ],
      finish_reason="length",
  )
  without = CompletionOutput(
      index=0, text="", token_ids=[2], cumulative_logprob=None, logprobs=None, finish_reason="stop"
  )
  outputs = [
      RequestOutput("0", "x", [1, 123], None, [with_lp], finished=True),
      RequestOutput("1", None, [5], None, [without], finished=True),
  ]
  doc = json.loads(decode_run.outputs_to_json(outputs, {"steps": 3, "wall_time_s": 0.25}, num_top_logprobs=2))
  assert doc == {
      "requests": [
          {
              "prompt_token_ids": [1, 123],
              "output_token_ids": [107, 108],
              "text": "hi",
              "finish_reason": "length",
              "logprobs": [
                  {"token_id": 107, "logprob": -0.5, "top": [[107, -0.5], [9, -1.25]]},
                  {"token_id": 108, "logprob": -2.0, "top": [[4, -1.0], [5, -1.5]]},
              ],
          },
          {"prompt_token_ids": [5], "output_token_ids": [2], "text": "", "finish_reason": "stop", "logprobs": []},
      ],
      "stats": {"steps": 3, "wall_time_s": 0.25},
  }


def test_a_request_that_can_never_fit_its_sliding_pool_exits_2_with_one_line(capsys):
  # Only sliding-window layers, so the up-front check (full-attention pools) passes and the scheduler finds at the
  # first step that a 10-token prefill chunk cannot get its blocks from a 1-block pool.
  args = [
      BASE,
      "decoder_block=gemma3",
      "layer_types=[sliding_attention, sliding_attention]",
      "sliding_window_size=4",
      "num_kv_blocks=2",
      "block_size=4",
  ]
  assert decode.main(args) == 2
  err = capsys.readouterr().err
  # The progress bar had started, so its line precedes the error; the error itself is one line, no traceback.
  assert "Traceback" not in err
  (line,) = [line for line in err.split("\n") if line.startswith("maxtext-decode: error: ")]
  assert err.endswith(line + "\n")
  assert re.search(r"request '0' can never fit: .* raise kv_cache_memory_bytes or num_kv_blocks", line), line


def test_one_cli_run_builds_the_config_once(monkeypatch, capsys):
  # Every build of a run config (the CLI's, LLM's, the adapter's) goes through model_loader's load_config.
  real = model_loader.load_config
  builds = []
  monkeypatch.setattr(model_loader, "load_config", lambda *a, **k: builds.append(a) or real(*a, **k))
  assert decode.main([BASE, *RUN, "prompt_token_ids=[1, 72, 105]", "max_new_tokens=2"]) == 0
  assert capsys.readouterr().out.strip()
  assert len(builds) == 1


def test_open_progress_bars_while_tqdm_is_half_imported(monkeypatch):
  # A Ctrl-C can land inside `import tqdm`, when the module is in sys.modules without its class yet: the handler
  # must still print its line and exit 130, so it finds no bar rather than raising.
  import types  # pylint: disable=import-outside-toplevel

  monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
  assert decode._open_progress_bars() == []  # pylint: disable=protected-access
  monkeypatch.delitem(sys.modules, "tqdm")
  assert decode._open_progress_bars() == []  # pylint: disable=protected-access
