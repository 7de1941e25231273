"""Tests of the byte-level tokenizer and local Hugging Face tokenizer.json loading."""

import json
import types

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from maxtext.inference.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer, tokenizer_from_config

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}


def _config(**values):
  base = {"tokenizer_path": "", "hf_model_path": "", "gguf_model_path": "", "vocab_size": 512}
  base.update(values)
  return types.SimpleNamespace(**base)


@pytest.fixture(name="hf_folder")
def fixture_hf_folder(tmp_path):
  """A folder with a tiny word-level tokenizer.json and a tokenizer_config.json naming bos / eos."""
  tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(["<s>", "</s>"])
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
  return tmp_path


def test_byte_tokenizer_round_trip():
  tokenizer = ByteTokenizer(300)
  text = "héllo, wörld ✓"
  ids = tokenizer.encode(text)
  assert ids == [b + 3 for b in text.encode("utf-8")]
  assert tokenizer.decode(ids) == text
  assert tokenizer.encode("a", add_bos=True) == [1, 100]
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (0, 1, 2, 300)


def test_byte_tokenizer_decode_drops_specials_and_replaces_bad_utf8():
  tokenizer = ByteTokenizer(512)
  assert tokenizer.decode([1, 3 + ord("o"), 2, 0, 299, 3 + ord("k")]) == "ok"
  assert tokenizer.decode([3 + 0xC3]) == "\ufffd"  # a lone UTF-8 lead byte


def test_byte_tokenizer_needs_259_ids():
  with pytest.raises(TokenizerError, match="needs vocab_size >= 259 .* got 258"):
    ByteTokenizer(258)


@pytest.mark.parametrize("use_file", [False, True])
def test_hf_tokenizer_from_folder_or_file(hf_folder, use_file):
  tokenizer = load_tokenizer(str(hf_folder / "tokenizer.json") if use_file else str(hf_folder))
  assert tokenizer.encode("hello world !") == [3, 4, 5]
  assert tokenizer.encode("hello", add_bos=True) == [1, 3]
  assert tokenizer.decode([1, 3, 4, 2]) == "hello world"
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 6)


def test_special_ids_fall_back_to_config_json(hf_folder):
  (hf_folder / "tokenizer_config.json").unlink()
  (hf_folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}), encoding="utf-8")
  tokenizer = HFTokenizer(str(hf_folder))
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
  (hf_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}), encoding="utf-8")
  assert HFTokenizer(str(hf_folder)).eos_token_id == 2  # "<eos>" is no token: config.json decides
  (hf_folder / "config.json").write_text(json.dumps({"eos_token_id": []}), encoding="utf-8")
  tokenizer = HFTokenizer(str(hf_folder))
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (None, None)


def test_load_errors(tmp_path, hf_folder):
  with pytest.raises(TokenizerError, match="tokenizer path is empty"):
    load_tokenizer("")
  with pytest.raises(TokenizerError, match=f"tokenizer path {tmp_path}/missing does not exist"):
    load_tokenizer(str(tmp_path / "missing"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(TokenizerError, match=f"{empty} has no tokenizer.json"):
    load_tokenizer(str(empty))
  (empty / "tokenizer.json").write_text("{not json", encoding="utf-8")
  with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
    load_tokenizer(str(empty))
  (hf_folder / "tokenizer_config.json").write_text("{broken", encoding="utf-8")
  with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
    load_tokenizer(str(hf_folder))


def test_tokenizer_from_config(hf_folder):
  assert isinstance(tokenizer_from_config(_config()), ByteTokenizer)
  assert isinstance(tokenizer_from_config(_config(tokenizer_path=str(hf_folder))), HFTokenizer)
  assert isinstance(tokenizer_from_config(_config(hf_model_path=str(hf_folder))), HFTokenizer)
  with pytest.raises(TokenizerError, match="has 6 ids but the model's vocab_size is 4"):
    tokenizer_from_config(_config(hf_model_path=str(hf_folder), vocab_size=4))
  with pytest.raises(TokenizerError, match="needs vocab_size >= 259"):
    tokenizer_from_config(_config(vocab_size=100))


@pytest.mark.parametrize(
    "files, expected",
    [
        ({}, None),
        ({"tokenizer_config.json": {"chat_template": "{{ 1 }}"}}, "{{ 1 }}"),
        (
            {
                "tokenizer_config.json": {
                    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
                }
            },
            "D",
        ),
        ({"tokenizer_config.json": {"chat_template": "{{ 1 }}"}, "chat_template.jinja": "{{ 2 }}"}, "{{ 2 }}"),
    ],
    ids=["none", "string", "named-list", "jinja-file-wins"],
)
def test_hf_tokenizer_chat_template_from_the_folder(hf_folder, files, expected):
  for name, content in files.items():
    text = content if isinstance(content, str) else json.dumps({"bos_token": "<s>", "eos_token": "</s>", **content})
    (hf_folder / name).write_text(text, encoding="utf-8")
  tokenizer = load_tokenizer(str(hf_folder))
  assert tokenizer.chat_template == expected
  assert (tokenizer.token_text(1), tokenizer.token_text(None)) == ("<s>", "")
  assert tokenizer.encode("<s> hello", add_special_tokens=False) == [1, 3]
