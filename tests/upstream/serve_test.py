"""`vllm serve` with this package's plugin on the CPU, spoken to by the `openai` client: completions and chat
completions, streamed and not, with logprobs, stop strings, max_tokens and n, and 8 requests at once. Every greedy
answer has the tokens (and prompt tokens) of this package's offline engine over the same folder
(serve_model.py), the logprobs within 1e-4. The server runs docs/serving.md's command and the client example there
runs unchanged; the server listens on 127.0.0.1 only, gets a bounded number of requests and is stopped by the test,
with every process it started. Request timings are printed at the end of the run (serve.py, conftest.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import subprocess
import time

import openai
import pytest

import cases
import serve
import stand_ins

MAX_TOKENS = cases.SERVE_MAX_TOKENS
LOGPROB_TOLERANCE = 1e-4
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 300
# vLLM's token ids back with every answer (the prompt's in the first streamed chunk, the answer's in each chunk).
TOKEN_IDS = {"return_token_ids": True}


def _main_python() -> str:
  return os.environ.get("MAXTEXT_MAIN_PYTHON", str(serve.HERE.parents[1] / ".venv" / "bin" / "python"))


def _main_env() -> dict[str, str]:
  """The main venv's environment: this checkout's package first, the CPU as JAX's platform."""
  path = os.pathsep.join(filter(None, [str(serve.HERE.parents[1] / "src"), os.environ.get("PYTHONPATH")]))
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


@pytest.fixture(name="served", scope="module")
def fixture_served(tmp_path_factory, scratch_home):
  """`{"server", "client", "model", "reference"}`: the folder built, the server healthy, the offline answers."""
  work = tmp_path_factory.mktemp("serve")
  folder, reference_path = work / "model", work / "reference.json"
  started = time.perf_counter()
  subprocess.run(
      [_main_python(), str(serve.HERE / "serve_model.py"), "build", str(folder)],
      check=True,
      timeout=BUILD_TIMEOUT_S,
      env=_main_env(),
      stdout=subprocess.DEVNULL,
  )
  # The offline answers are computed while the server starts.
  offline = subprocess.Popen(  # pylint: disable=consider-using-with  # waited for below
      [_main_python(), str(serve.HERE / "serve_model.py"), "reference", str(folder), str(reference_path)],
      env=_main_env(),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )
  port = serve.free_port()
  env = {**os.environ, **stand_ins.environment(), "HOME": str(scratch_home)}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(serve.SITE), env.get("PYTHONPATH")]))
  server = serve.start(serve.doc_command(str(folder), port), env, work / "server.log", port)
  try:
    server.wait_healthy(STARTUP_TIMEOUT_S)
    serve.DURATIONS["build, start, /health"] = time.perf_counter() - started
    _, errors = offline.communicate(timeout=BUILD_TIMEOUT_S)
    assert offline.returncode == 0, f"the offline reference failed:\n{errors[-3000:]}"
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    yield {
        "server": server,
        "client": client,
        "model": str(folder),
        "reference": json.loads(reference_path.read_text(encoding="utf-8")),
    }
  finally:
    if offline.poll() is None:
      offline.kill()
      offline.wait()
    server.stop()


def _timed(kind: str, call):
  """Runs one request, records its time and completion tokens."""
  start = time.perf_counter()
  response = call()
  seconds = time.perf_counter() - start
  serve.record(kind, seconds, sum(len(getattr(c, "token_ids", None) or ()) for c in response.choices))
  return response


def _check_logprobs(server_rows: list[tuple[int, float, dict[int, float]]], reference: list) -> None:
  """Each token's logprob and its top-3 within 1e-4 of the offline engine's (same top-3 ids)."""
  assert len(server_rows) == len(reference)
  for (token_id, logprob, top), (ref_logprob, ref_top) in zip(server_rows, reference):
    assert abs(logprob - ref_logprob) < LOGPROB_TOLERANCE, token_id
    assert set(top) == {i for i, _ in ref_top}
    for i, ref in ref_top:
      assert abs(top[i] - ref) < LOGPROB_TOLERANCE, (token_id, i)


def _token_id(text: str) -> int:
  """vLLM's `token_id:N` form of a token (return_tokens_as_token_ids)."""
  assert text.startswith("token_id:"), text
  return int(text.removeprefix("token_id:"))


def test_the_server_runs_the_documented_command_with_the_stand_ins_in_every_process(served):
  command = " ".join(served["server"].process.args)
  assert f"--max-model-len {cases.SERVE_MAX_MODEL_LEN} --max-num-seqs 8" in command  # the offline engine's length
  assert "--host 127.0.0.1" in command
  log = served["server"].log()
  start = time.perf_counter()
  assert served["client"].models.list().data[0].id == served["model"]
  serve.record("models", time.perf_counter() - start, 0)
  engine_core = {int(pid) for pid in re.findall(r"\(EngineCore pid=(\d+)\)", log)}
  installed = {int(pid) for pid in serve.STANDS_IN.findall(log)}
  assert engine_core and engine_core <= installed  # the engine core is a child process with the stand-ins
  assert served["server"].process.pid in installed  # and so is the API server


def test_completion_with_logprobs_matches_the_offline_engine(served):
  client, reference = served["client"], served["reference"]["completions"][0]
  response = _timed(
      "completion, logprobs=3",
      lambda: client.completions.create(
          model=served["model"],
          prompt=cases.SERVE_COMPLETIONS[0],
          max_tokens=MAX_TOKENS,
          temperature=0,
          logprobs=3,
          extra_body={**TOKEN_IDS, "return_tokens_as_token_ids": True},
      ),
  )
  (choice,) = response.choices
  assert choice.prompt_token_ids == reference["prompt_token_ids"]
  assert choice.token_ids == reference["token_ids"]
  assert choice.text == reference["text"]
  assert choice.finish_reason == reference["finish_reason"] == "length"
  assert response.usage.completion_tokens == MAX_TOKENS
  assert [_token_id(t) for t in choice.logprobs.tokens] == reference["token_ids"]
  rows = [
      (_token_id(token), logprob, {_token_id(k): v for k, v in top.items()})
      for token, logprob, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
  ]
  _check_logprobs(rows, reference["logprobs"])


def test_streamed_completion_matches_the_offline_engine(served):
  client, reference = served["client"], served["reference"]["completions"][1]
  start = time.perf_counter()
  stream = client.completions.create(
      model=served["model"],
      prompt=cases.SERVE_COMPLETIONS[1],
      max_tokens=MAX_TOKENS,
      temperature=0,
      stream=True,
      extra_body=TOKEN_IDS,
  )
  text, tokens, prompt_ids, finish, first = "", [], None, None, None
  for chunk in stream:
    (choice,) = chunk.choices
    first = first or time.perf_counter() - start
    text += choice.text
    tokens += choice.token_ids or []
    prompt_ids = prompt_ids or choice.prompt_token_ids
    finish = choice.finish_reason or finish
  serve.record("completion, streamed", time.perf_counter() - start, len(tokens))
  serve.DURATIONS["completion, streamed: first chunk"] = first
  assert (prompt_ids, tokens, text) == (reference["prompt_token_ids"], reference["token_ids"], reference["text"])
  assert finish == "length"


def test_stop_string_ends_the_answer_before_it(served):
  """The stop string is the text of a token the greedy answer reaches (serve_model.py picks it): the answer ends
  with the token that holds it, and its text ends before it."""
  client, stop = served["client"], served["reference"]["stop"]
  assert stop, "the offline answer has no token text to stop on; change cases.SERVE_COMPLETIONS[0]"
  reference = served["reference"]["completions"][0]
  response = _timed(
      "completion, stop",
      lambda: client.completions.create(
          model=served["model"],
          prompt=cases.SERVE_COMPLETIONS[0],
          max_tokens=MAX_TOKENS,
          temperature=0,
          stop=[stop["string"]],
          extra_body=TOKEN_IDS,
      ),
  )
  (choice,) = response.choices
  assert choice.token_ids == reference["token_ids"][: stop["num_tokens"]]
  assert choice.text == stop["text"]
  assert (choice.finish_reason, choice.stop_reason) == ("stop", stop["string"])


def test_n_choices_with_max_tokens(served):
  """n=2 needs random sampling in vLLM; top_k=1 keeps only the most likely token, so both choices are the greedy
  answer, cut at max_tokens."""
  client, reference = served["client"], served["reference"]["completions"][2]
  short = 5
  response = _timed(
      "completion, n=2",
      lambda: client.completions.create(
          model=served["model"],
          prompt=cases.SERVE_COMPLETIONS[2],
          max_tokens=short,
          temperature=1.0,
          n=2,
          extra_body={**TOKEN_IDS, "top_k": 1},
      ),
  )
  assert sorted(c.index for c in response.choices) == [0, 1]
  for choice in response.choices:
    assert choice.token_ids == reference["token_ids"][:short]
    assert choice.finish_reason == "length"
  assert response.usage.completion_tokens == 2 * short


def test_a_per_request_seed_is_refused(served):
  """tpu-inference 0.32.0 refuses a request's own `seed` (its platform's `validate_request`: "JAX does not support
  per-request seed."); vLLM's server answers 500 with an empty message."""
  client = served["client"]
  start = time.perf_counter()
  with pytest.raises(openai.InternalServerError) as refused:
    client.completions.create(
        model=served["model"], prompt=cases.SERVE_COMPLETIONS[3], max_tokens=MAX_TOKENS, temperature=1.0, seed=7
    )
  serve.record("completion, seed (refused)", time.perf_counter() - start, 0)
  assert refused.value.status_code == 500


def test_chat_with_logprobs_matches_the_offline_engine(served):
  """The system and user messages through the folder's chat template: vLLM's prompt tokens are this package's."""
  client, reference = served["client"], served["reference"]["chats"][1]
  response = _timed(
      "chat, logprobs=3",
      lambda: client.chat.completions.create(
          model=served["model"],
          messages=list(cases.SERVE_CHATS[1]),
          max_tokens=MAX_TOKENS,
          temperature=0,
          logprobs=True,
          top_logprobs=3,
          extra_body={**TOKEN_IDS, "return_tokens_as_token_ids": True},
      ),
  )
  (choice,) = response.choices
  assert response.prompt_token_ids == reference["prompt_token_ids"]
  assert choice.token_ids == reference["token_ids"]
  assert choice.message.role == "assistant"
  assert choice.message.content == reference["text"]
  assert choice.finish_reason == "length"
  rows = [
      (_token_id(c.token), c.logprob, {_token_id(t.token): t.logprob for t in c.top_logprobs})
      for c in choice.logprobs.content
  ]
  _check_logprobs(rows, reference["logprobs"])


def test_streamed_chat_matches_the_offline_engine(served):
  client, reference = served["client"], served["reference"]["chats"][0]
  start = time.perf_counter()
  stream = client.chat.completions.create(
      model=served["model"],
      messages=list(cases.SERVE_CHATS[0]),
      max_tokens=MAX_TOKENS,
      temperature=0,
      stream=True,
      extra_body=TOKEN_IDS,
  )
  text, tokens, prompt_ids, finish, first = "", [], None, None, None
  for chunk in stream:
    prompt_ids = prompt_ids or getattr(chunk, "prompt_token_ids", None)
    (choice,) = chunk.choices
    first = first or time.perf_counter() - start
    text += choice.delta.content or ""
    tokens += getattr(choice, "token_ids", None) or []
    finish = choice.finish_reason or finish
  serve.record("chat, streamed", time.perf_counter() - start, len(tokens))
  serve.DURATIONS["chat, streamed: first chunk"] = first
  assert (prompt_ids, tokens, text) == (reference["prompt_token_ids"], reference["token_ids"], reference["text"])
  assert finish == "length"


def test_eight_concurrent_requests_each_match_the_offline_engine(served):
  """Eight completions from eight threads at once (the server's --max-num-seqs): vLLM batches them, and every
  answer is still the one the offline engine gives."""
  client, references = served["client"], served["reference"]["completions"]
  prompts = cases.SERVE_COMPLETIONS
  assert len(prompts) == 8

  def one(prompt: str):
    return _timed(
        "completion, 8 concurrent",
        lambda: client.completions.create(
            model=served["model"], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=TOKEN_IDS
        ),
    )

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    responses = list(pool.map(one, prompts))
  serve.DURATIONS["8 concurrent completions, wall"] = time.perf_counter() - start
  for response, reference in zip(responses, references):
    (choice,) = response.choices
    assert choice.prompt_token_ids == reference["prompt_token_ids"]
    assert choice.token_ids == reference["token_ids"]
    assert choice.text == reference["text"]


def test_the_serving_guide_client_example_runs_unchanged(served):
  """docs/serving.md's client example, run as it stands against this server (its address is the only change)."""
  source = serve.doc_block("python", "from openai import OpenAI")
  assert source.count(serve.DOC_BASE_URL) == 1
  source = source.replace(serve.DOC_BASE_URL, served["server"].base_url)
  out = io.StringIO()
  start = time.perf_counter()
  with contextlib.redirect_stdout(out):
    exec(compile(source, "docs/serving.md", "exec"), {"__name__": "serving_md"})  # pylint: disable=exec-used
  serve.record("docs/serving.md example (models, completion, chat)", time.perf_counter() - start, 0, requests=3)
  lines = out.getvalue().splitlines()
  assert len(lines) >= 2 and all(lines), out.getvalue()


def test_the_server_stops_with_every_process_it_started(served):
  """SIGTERM to the API server ends it and the engine core, and no process of its group is left. Nothing logs a
  traceback while serving. At shutdown vLLM 0.32.0 may log one spurious EngineDeadError traceback from its output
  handler, which races the engine core's teardown (vllm-project/vllm#48745); that one is allowed."""
  server = served["server"]
  assert server.stop() == 0
  assert not serve.group_alive(server.process.pid)
  serving, trigger, shutdown = server.log().partition("[shutdown] API server: shutdown triggered")
  assert trigger, server.tail(60)
  assert "Traceback" not in serving, server.tail(60)
  assert shutdown.count("Traceback") == shutdown.count("AsyncLLM output_handler failed.") <= 1, shutdown
  assert shutdown.count("Traceback") == shutdown.count("EngineDeadError: EngineCore encountered an issue"), shutdown
