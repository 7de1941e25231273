"""A typical vLLM offline program, run unchanged on two engines: `vllm.LLM` (vLLM 0.32 over tpu-inference's runner,
in the vllm-tpu venv) and `maxtext.inference.LLM` (this package's engine, in the main venv).

    python tests/upstream/conformance_program.py vllm|maxtext SPEC.json OUT.json

Only the import differs (`ENGINES`); SPEC gives the `LLM(...)` keywords of the engine (vLLM needs the plugin's
architecture override and the `maxtext_config`; this package reads the folder as it is) and the model folder. The
program writes everything it read from the outputs as JSON, for conformance_test.py to compare:
  - `greedy`: several prompts, greedy, logprobs=3, prompt_logprobs=2;
  - `stop`: a stop string taken from the first greedy text (the same on both engines when the greedy text is);
  - `n_greedy`: n=2 with top_k=1 (vLLM refuses n > 1 with temperature 0), so both sequences are the greedy one;
  - `penalties`: greedy with the three penalties and min_tokens, ignore_eos;
  - `sampled`: temperature 0.8, top_p 0.95, n=2 under the LLM's seed: the structure only (the generators differ);
  - `chat`: `LLM.chat` through the folder's chat template, greedy, logprobs=1;
  - `no_params`: `generate` without SamplingParams (the folder's generation_config.json) and
    `get_default_sampling_params()`;
  - `request_seed`: a per-request seed, or the error it raises;
  - `fields`: the attribute names of `RequestOutput` and `CompletionOutput`, and of the logprob records.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

ENGINES = {"vllm": "vllm", "maxtext": "maxtext.inference"}
PROMPTS = ("The quick brown fox", "A server answers", "Name a color:")
CONVERSATION = (
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does the server do?"},
)
MAX_TOKENS = 12


def _logprobs(positions) -> list | None:
  """`[{token id: Logprob}]` (None entries kept) as `[[[id, logprob, rank, decoded], ...] | None]`, in dict order."""
  if positions is None:
    return None
  return [
      None if p is None else [[int(t), float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in p.items()]
      for p in positions
  ]


def _completion(c) -> dict:
  return {
      "index": c.index,
      "text": c.text,
      "token_ids": [int(t) for t in c.token_ids],
      "cumulative_logprob": c.cumulative_logprob,
      "logprobs": _logprobs(c.logprobs),
      "finish_reason": c.finish_reason,
      "stop_reason": c.stop_reason,
      "finished": c.finished(),
  }


def _output(o) -> dict:
  return {
      "prompt": o.prompt,
      "prompt_token_ids": [int(t) for t in o.prompt_token_ids],
      "prompt_logprobs": _logprobs(o.prompt_logprobs),
      "finished": o.finished,
      "num_cached_tokens": o.num_cached_tokens,
      "outputs": [_completion(c) for c in o.outputs],
  }


def _stop_string(text: str) -> str:
  """Two characters from the middle of `text`, whose first occurrence is where the text is cut."""
  middle = len(text) // 2
  return text[middle : middle + 2]


def _params_fields(p) -> dict:
  names = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "repetition_penalty", "n", "seed", "logprobs")
  return {name: getattr(p, name) for name in names}


def main(engine: str, spec_path: str, out_path: str) -> None:
  spec = json.loads(pathlib.Path(spec_path).read_text(encoding="utf-8"))
  api = importlib.import_module(ENGINES[engine])
  LLM, SamplingParams = api.LLM, api.SamplingParams  # pylint: disable=invalid-name

  llm = LLM(model=spec["model"], seed=0, **spec["llm_kwargs"])
  result = {}
  greedy = llm.generate(
      list(PROMPTS), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2), use_tqdm=False
  )
  result["greedy"] = [_output(o) for o in greedy]
  stop = _stop_string(greedy[0].outputs[0].text)
  result["stop_string"] = stop
  params = [
      SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]),
      SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], include_stop_str_in_output=True),
  ]
  result["stop"] = [_output(o) for o in llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False)]
  n_greedy = SamplingParams(temperature=1.0, top_k=1, n=2, max_tokens=MAX_TOKENS)
  result["n_greedy"] = [_output(o) for o in llm.generate(list(PROMPTS[:2]), n_greedy, use_tqdm=False)]
  penalties = SamplingParams(
      temperature=0,
      max_tokens=MAX_TOKENS,
      repetition_penalty=1.3,
      presence_penalty=0.5,
      frequency_penalty=0.4,
      min_tokens=4,
      ignore_eos=True,
      skip_special_tokens=False,
  )
  result["penalties"] = [_output(o) for o in llm.generate(list(PROMPTS), penalties, use_tqdm=False)]
  sampled = SamplingParams(temperature=0.8, top_p=0.95, n=2, max_tokens=8)
  result["sampled"] = [_output(o) for o in llm.generate(list(PROMPTS), sampled, use_tqdm=False)]
  chat = llm.chat(list(CONVERSATION), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1), use_tqdm=False)
  result["chat"] = [_output(o) for o in chat]
  result["default_params"] = _params_fields(llm.get_default_sampling_params())
  result["no_params"] = [_output(o) for o in llm.generate(PROMPTS[0], use_tqdm=False)]
  try:
    seeded = llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=4), use_tqdm=False)
    result["request_seed"] = {"tokens": len(seeded[0].outputs[0].token_ids)}
  except Exception as e:  # pylint: disable=broad-exception-caught  # the error is the result
    result["request_seed"] = {"error": f"{type(e).__name__}: {e}"}
  first = greedy[0].outputs[0]
  result["fields"] = {
      "RequestOutput": sorted(vars(greedy[0])),
      "CompletionOutput": sorted(vars(first)),
      "Logprob": sorted(vars(next(iter(first.logprobs[0].values())))),
  }
  result["tokenizer"] = list(llm.get_tokenizer().encode(PROMPTS[2]))
  pathlib.Path(out_path).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
  if sys.argv[1] == "vllm":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import stand_ins  # pylint: disable=import-error,wrong-import-position  # the tier's; must come before vLLM

    stand_ins.install()
  main(*sys.argv[1:4])
