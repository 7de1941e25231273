"""The folder `vllm serve` serves in the upstream tier, and this package's offline greedy tokens over it, in the main
(Python 3.11) venv.

    .venv/bin/python tests/upstream/serve_model.py build FOLDER
    .venv/bin/python tests/upstream/serve_model.py reference FOLDER OUT.json

`build` writes a tiny Llama (tests/hf_cases.py, by transformers' save_pretrained) with what a served model needs and
the tier's other folders lack: a byte-level BPE tokenizer trained here to the model's 512-token vocabulary, whose
post-processor puts bos before a prompt as Llama's does, and a Jinja chat template in tokenizer_config.json.
Its alphabet is the ASCII characters of a built-in text (see CORPUS).
`reference` runs `maxtext.inference.LLM` over the folder on `cases.SERVE_COMPLETIONS` (text prompts, tokenized as
this package tokenizes them) and `cases.SERVE_CHATS` (through the model's chat template), all greedy in one
`generate` call, and writes for each the prompt ids, the tokens, their text and finish reason, and the sampled and
top-3 logprobs of every token; and for the first completion a stop string that the greedy text reaches, with the
text and token count a request stopped by it must return.
"""

from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # cases; tests/, for hf_cases
import cases  # pylint: disable=wrong-import-position

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: transformers' Llama config's pad, bos and eos
# bos once at the start, each message closed by eos; the model's turn opens with its role line.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
# The tokenizer's alphabet is the characters of this text (ASCII, newline included), so that every token decodes to
# whole characters: with byte tokens a random model samples partial UTF-8 sequences, whose text the server's
# incremental detokenizer and a one-shot decode may render differently. The words give the merges that fill the
# vocabulary.
CORPUS = (
    "The quick brown fox jumps over the lazy dog while the server answers every request in turn.\n"
    "What does the server do? It listens on a port, queues prompts, batches them and streams the words back.\n"
    "You answer briefly. Name a color: red, green, blue, yellow, purple, orange, black, white or gray.\n"
    "Numbers like 0, 1, 2, 3, 10, 42, 128 and 512 appear in logs; so do #, $, %, &, *, +, -, /, <, =, >, @, _ and ~.\n"
    "[brackets] {braces} (parentheses) 'quotes' \"double\" `ticks` | pipes ^ carets ! marks ; semicolons \\ slashes\n"
    "### system:\n### user:\n### assistant:\n"
    "ability absolute accept account across action active actual address advance advice afford agency agenda "
    "balance battery beautiful because become before behavior believe benefit between beyond billion bottom "
    "cabinet calculate campaign capacity capital capture careful category central century certain challenge "
    "channel chapter character chemical children circle citizen classic climate clinical collect college "
    "comfort command comment commercial common community company compare complete complex computer concept "
    "decade decision declare decrease default defense define degree deliver demand density deploy describe "
    "design detail develop device dialogue different digital dinner direction discover display distance "
    "economy editor education effect effort election element emotion employee energy engine enough entire "
    "factor failure family famous farmer feature federal feeling figure finally finance finger forest former "
    "garden general generate gesture global govern gradient graphic ground growth guidance habit handle "
    "happen harvest health hidden history holiday horizon hospital however hundred identity imagine impact "
    "improve include income indicate industry inference inform initial inside instance interest interval "
    "journey judgment justice keyboard kitchen knowledge language largely launch layer leader learning "
    "machine manager margin market material matter measure medium memory message method middle minute "
    "natural network neutral nothing notice number object observe obtain office operate opinion option "
    "package parallel partner pattern perform period person picture planet player pocket policy position "
    "quality quarter question radical random reason receive record reduce region release remain report "
    "sample scatter schedule science screen season second section select sequence service session shadow "
    "tensor thought through token traffic transfer travel treatment trouble typical uniform unique update "
    "validate valley variable vector version village visible volume weather weight welcome window wonder "
    "yesterday zero\n",
)


def build(folder: str) -> None:
  """Writes the model (config.json, model.safetensors) and the tokenizer files into `folder`."""
  # pylint: disable=import-outside-toplevel  # torch and transformers load only for the build
  from hf_cases import build_hf_model
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  out = pathlib.Path(folder)
  model = build_hf_model(cases.SERVE_FAMILY)
  model.save_pretrained(str(out))
  vocab_size = int(model.config.vocab_size)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS),
      show_progress=False,
  )
  tokenizer.train_from_iterator(CORPUS, trainer)
  if tokenizer.get_vocab_size() != vocab_size:  # every id the model can sample must decode
    raise SystemExit(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model {vocab_size}: add text")
  bos = SPECIAL_TOKENS[1]
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
  )
  tokenizer.save(str(out / "tokenizer.json"))
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "pad_token": SPECIAL_TOKENS[0],
      "bos_token": SPECIAL_TOKENS[1],
      "eos_token": SPECIAL_TOKENS[2],
      "model_max_length": cases.SERVE_MAX_MODEL_LEN,
      "chat_template": CHAT_TEMPLATE,
  }
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _stop_string(tokenizer, tokens: list[int]) -> dict | None:
  """A stop string the greedy text reaches at a token other than the first: the text of one ASCII token, two
  characters or more, that does not occur earlier. A request stopped by it returns the text before it and the
  tokens up to the one that holds it."""
  for k in range(1, len(tokens)):
    before, text = tokenizer.decode(tokens[:k]), tokenizer.decode(tokens[: k + 1])
    piece = tokenizer.decode(tokens[k : k + 1])
    if len(piece.strip()) >= 2 and piece.isascii() and text == before + piece and text.find(piece) == len(before):
      return {"string": piece, "text": before, "num_tokens": k + 1}
  return None


def _position(token: int, logprobs: dict) -> list:
  """[the token's logprob, [[id, logprob] of the 3 most likely, most likely first]] from one `{id: Logprob}`."""
  top = sorted(logprobs.items(), key=lambda item: (-item[1].logprob, item[0]))[:3]
  return [logprobs[token].logprob, [[t, lp.logprob] for t, lp in top]]


def reference(folder: str, out_path: str) -> None:
  """Writes the offline engine's greedy answers to every serve case (see the module docstring)."""
  # pylint: disable=import-outside-toplevel  # after sys.path is set
  from maxtext.inference import LLM, SamplingParams

  llm = LLM(
      hf_model_path=folder,
      max_target_length=cases.SERVE_MAX_MODEL_LEN,
      max_num_seqs=len(cases.SERVE_COMPLETIONS) + len(cases.SERVE_CHATS),
      **cases.MAXTEXT_CONFIG,
  )
  prompts = [llm.prompt_token_ids(text) for text in cases.SERVE_COMPLETIONS]
  prompts += [llm.apply_chat_template(list(messages)) for messages in cases.SERVE_CHATS]
  params = SamplingParams(temperature=0.0, max_tokens=cases.SERVE_MAX_TOKENS, logprobs=3)
  answers = []
  for ids, output in zip(prompts, llm.generate(prompts, params)):
    completion = output.outputs[0]
    answers.append(
        {
            "prompt_token_ids": ids,
            "token_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "logprobs": [_position(token, lps) for token, lps in zip(completion.token_ids, completion.logprobs)],
        }
    )
  n = len(cases.SERVE_COMPLETIONS)
  result = {
      "completions": answers[:n],
      "chats": answers[n:],
      "stop": _stop_string(llm.tokenizer, answers[0]["token_ids"]),
  }
  pathlib.Path(out_path).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
  if sys.argv[1] == "build":
    build(sys.argv[2])
  else:
    reference(sys.argv[2], sys.argv[3])
