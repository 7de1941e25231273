"""GGUF `gemma3` files as llama.cpp's converter writes them (its tensor names, every norm weight stored as 1 + w, the
sliding window in the metadata, tied embeddings, a SentencePiece vocabulary): loaded here like the same weights in a
Hugging Face folder.

Expected values never come from the loader: the file is written from a transformers model's own state dict, and the
tokenizer is compared with transformers' reading of the same file.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.checkpoint import gguf as gguf_loader
from maxtext.checkpoint import hf, hf_config, load_model, load_run_config
from maxtext.inference.tokenizer import HFTokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

CASE = "gemma3_gguf"
# Hugging Face names (after `model.layers.{i}.`) -> llama.cpp's gemma3 names (after `blk.{i}.`).
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, UNK = 0, 1, 2, 3
# SentencePiece pieces in the order of Gemma's vocabulary: characters, then merged pieces in merge order; a run of
# spaces is stored as real spaces, as in Gemma's files.
PIECES = list("▁helowrdta!") + "he ll ▁w or hell ▁wor hello ▁world ▁t ▁th th ▁the".split() + ["  ", "ld"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _vocab(size: int) -> tuple[list[str], list[float], list[int]]:
  """(tokens, scores, token types) of a Gemma-like SentencePiece vocabulary of `size` tokens."""
  tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
  types = [3] * len(SPECIALS) + [6] * 256 + [1] * len(PIECES)
  types[UNK] = 2
  fillers = size - len(tokens)
  assert fillers >= 0
  tokens += [f"[unused{i}]" for i in range(fillers)]
  types += [4] * fillers
  scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(tokens) - len(SPECIALS) - 256)]
  return tokens, scores, types


def _gguf_name(hf_name: str) -> str:
  if hf_name == "model.embed_tokens.weight":
    return "token_embd.weight"
  if hf_name == "model.norm.weight":
    return "output_norm.weight"
  _, _, i, rest = hf_name.split(".", 3)
  return f"blk.{i}.{_TO_GGUF[rest]}"


def write_gemma3(path, state_dict: dict[str, np.ndarray], config, sliding_window: bool = True) -> None:
  """Writes a Gemma 3 GGUF the way llama.cpp's converter does: norms + 1, its names and metadata, no output.weight
  (tied), a SentencePiece vocabulary (no merges) and the chat template."""
  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_block_count(config.num_hidden_layers)
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
  writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
  writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
  if sliding_window:
    writer.add_sliding_window(config.sliding_window)
  _add_tokenizer(writer, config.vocab_size)
  for name, array in state_dict.items():
    if name == "lm_head.weight":
      continue  # tied
    stored = array + np.float32(1.0) if name.endswith("norm.weight") else array
    writer.add_tensor(_gguf_name(name), np.ascontiguousarray(stored, dtype=np.float32))
  _finish(writer)


def _add_tokenizer(writer, size: int, add_bos: bool | None = True) -> None:
  """The tokenizer metadata llama.cpp's converter writes for Gemma 3 (`add_bos` None: no add_bos_token key)."""
  tokens, scores, types = _vocab(size)
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_bos_token_id(BOS)
  writer.add_eos_token_id(EOS)
  writer.add_unk_token_id(UNK)
  writer.add_pad_token_id(PAD)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  writer.add_add_eos_token(False)
  writer.add_add_space_prefix(False)
  writer.add_chat_template(TEMPLATE)


def _finish(writer) -> None:
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.fixture(name="gemma3_files", scope="module")
def fixture_gemma3_files(hf_checkpoint, tmp_path_factory):
  """(Hugging Face folder, GGUF file of the same weights, torch model)."""
  folder, torch_model = hf_checkpoint(CASE)
  state = {name: t.detach().numpy() for name, t in torch_model.state_dict().items()}
  path = tmp_path_factory.mktemp("gemma3_gguf") / "gemma3.gguf"
  write_gemma3(path, state, torch_model.config)
  return folder, path, torch_model


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


@pytest.mark.hf
def test_the_config_matches_the_hugging_face_folders(gemma3_files):
  folder, path, _ = gemma3_files
  ours = dict(load_run_config(gguf_model_path=str(path)))
  ref = dict(hf.load_hf_config(folder))
  keys = [
      "decoder_block",
      "base_emb_dim",
      "base_num_decoder_layers",
      "base_num_query_heads",
      "base_num_kv_heads",
      "head_dim",
      "base_mlp_dim",
      "vocab_size",
      "layer_types",
      "sliding_window_size",
      "inhomogeneous_layer_cycle_interval",
      "query_pre_attn_scalar",
      "rope_max_timescale",
      "local_rope_max_timescale",
      "rope_type",
      "rope_scaling_factor",
      "mlp_activations",
      "logits_via_embedding",
      "final_logits_soft_cap",
  ]
  assert {k: ours[k] for k in keys} == {k: ref[k] for k in keys}
  # GGUF stores the epsilon as a float32
  assert ours["normalization_layer_epsilon"] == pytest.approx(ref["normalization_layer_epsilon"], rel=1e-7)
  assert ours["sliding_window_size"] == 5 and ours["query_pre_attn_scalar"] == 32
  assert list(ours["layer_types"]) == ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.hf
def test_logits_equal_the_hugging_face_folders_and_transformers(gemma3_files, random_tokens):
  folder, path, torch_model = gemma3_files
  import torch  # pylint: disable=import-outside-toplevel  # optional test dependency (hf marker)

  tokens = random_tokens(24)  # crosses the window of 5
  model = load_model(load_run_config(gguf_model_path=str(path)), progress=False)
  _, hf_model = hf.load_hf_model(folder, progress=False)
  ours = np.asarray(_forward(model, jnp.asarray(tokens)))
  np.testing.assert_allclose(ours, np.asarray(_forward(hf_model, jnp.asarray(tokens))), atol=1e-5, rtol=0)
  with torch.no_grad():
    ref = torch_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_gemma3_tensor_names_differ_from_llamas():
  assert (
      gguf_loader.hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
  )
  assert gguf_loader.hf_tensor_name("blk.2.ffn_norm.weight", "llama") == "model.layers.2.post_attention_layernorm.weight"
  assert gguf_loader.hf_tensor_name("blk.0.post_ffw_norm.weight", "gemma3") == (
      "model.layers.0.post_feedforward_layernorm.weight"
  )
  assert gguf_loader.hf_tensor_name("blk.0.post_ffw_norm.weight", "qwen3") == "blk.0.post_ffw_norm.weight"


@pytest.mark.hf
def test_a_missing_sliding_window_is_named(gemma3_files, tmp_path):
  _, _, torch_model = gemma3_files
  state = {name: t.detach().numpy() for name, t in torch_model.state_dict().items()}
  path = tmp_path / "nowindow.gguf"
  write_gemma3(path, state, torch_model.config, sliding_window=False)
  with pytest.raises(gguf_loader.GGUFError, match=r"nowindow.gguf: metadata gemma3.attention.sliding_window is missing"):
    gguf_loader.load_gguf_config(path)


@pytest.fixture(name="tokenizer_file")
def fixture_tokenizer_file(tmp_path):
  """A GGUF file holding only the metadata of a Gemma 3 vocabulary of 320 tokens."""
  path = tmp_path / "tokenizer.gguf"
  writer = gguf.GGUFWriter(str(path), "gemma3")
  _add_tokenizer(writer, 320)
  _finish(writer)
  return path


def test_the_sentencepiece_vocabulary_encodes_with_byte_fallback_and_whole_control_tokens(tokenizer_file):
  parts = gguf_loader.load_gguf_tokenizer(tokenizer_file)
  tokenizer = parts.tokenizer
  assert tokenizer.encode("hello world", add_special_tokens=False).tokens == ["hello", "▁world"]
  assert tokenizer.encode(" the", add_special_tokens=False).tokens == ["▁the"]
  assert tokenizer.encode("hé!", add_special_tokens=False).tokens == ["h", "<0xC3>", "<0xA9>", "!"]
  assert tokenizer.encode("<start_of_turn>hello<unk>", add_special_tokens=False).tokens == [
      "<start_of_turn>",
      "hello",
      "<unk>",
  ]
  assert (parts.bos_token_id, parts.eos_token_id, parts.add_bos_token) == (BOS, EOS, True)
  assert parts.chat_template == TEMPLATE
  ours = HFTokenizer.from_gguf(str(tokenizer_file))
  ids = ours.encode("hello wörld €!", add_bos=True)
  assert ids[0] == BOS and ours.decode(ids) == "hello wörld €!"


def test_sentencepiece_merges_follow_the_vocabulary_order():
  # "abc" comes before its parts: its splits merge first, the longer left piece first.
  pieces = ["a", "b", "c", "d", "abc", "ab", "cd", "bc"]
  merges = gguf_loader._vocabulary_order_merges(pieces)  # pylint: disable=protected-access  # a pure helper
  assert merges == [("ab", "c"), ("a", "bc"), ("a", "b"), ("c", "d"), ("b", "c")]


def test_sentencepiece_merges_are_kept_by_their_vocabulary_and_remade_when_unreadable(tmp_path, monkeypatch):
  pieces = ["a", "b", "c", "d", "abc", "ab", "cd", "bc"]
  want = [("ab", "c"), ("a", "bc"), ("a", "b"), ("c", "d"), ("b", "c")]
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  assert gguf_loader.merges_cache_folder() == tmp_path / "tokenizers"
  assert gguf_loader.cached_vocabulary_order_merges(pieces) == want
  (kept,) = (tmp_path / "tokenizers").iterdir()
  np.testing.assert_array_equal(np.load(kept), [[5, 2], [0, 7], [0, 1], [2, 3], [1, 2]])  # the pieces' ids
  np.save(kept, np.asarray([[6, 2]], np.int32))  # a kept file is read as it is: ("cd", "c")
  assert gguf_loader.cached_vocabulary_order_merges(pieces) == [("cd", "c")]
  assert gguf_loader.cached_vocabulary_order_merges(pieces + ["e"]) == want  # another vocabulary, another file
  assert len(list((tmp_path / "tokenizers").iterdir())) == 2
  for bad in (np.asarray([[0, 8]], np.int32), np.asarray([0, 1], np.int32), np.asarray([[0.0, 1.0]])):
    np.save(kept, bad)  # ids out of range, the wrong shape or dtype: made again and replaced
    assert gguf_loader.cached_vocabulary_order_merges(pieces) == want
    np.testing.assert_array_equal(np.load(kept), [[5, 2], [0, 7], [0, 1], [2, 3], [1, 2]])
  kept.write_bytes(b"not an array")
  assert gguf_loader.cached_vocabulary_order_merges(pieces) == want
  blocked = tmp_path / "file"
  blocked.write_text("a file where the folder would be")
  assert gguf_loader.cached_vocabulary_order_merges(pieces, blocked / "tokenizers") == want  # not kept, still made


@pytest.mark.hf
def test_sentencepiece_merges_are_those_transformers_derives_for_gemma():
  tokenization_utils_base = pytest.importorskip("transformers.tokenization_utils_base")
  tokens, _, _ = _vocab(320)
  pieces = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens] + ["abc", "ab", "bc", "c"]
  positions = {piece: -i for i, piece in enumerate(pieces)}
  ref = tokenization_utils_base.generate_merges({p: i for i, p in enumerate(pieces)}, positions)
  assert gguf_loader._vocabulary_order_merges(pieces) == ref  # pylint: disable=protected-access  # a pure helper


@pytest.mark.hf
@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "hello  world",
        "   the world!  ",
        " héllo wörld € 日本",
        "<start_of_turn>user\nhello<end_of_turn>\n",
        "[unused3] hello\t[unused40]",
        "<unk> <bos>the",
    ],
)
def test_the_tokenizer_encodes_and_decodes_as_transformers_reads_the_file(gemma3_files, text):
  transformers = pytest.importorskip("transformers")
  _, path, _ = gemma3_files
  ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  ours = HFTokenizer.from_gguf(str(path))
  ids = ours.encode(text, add_bos=True)
  assert ids == ref.encode(text)
  assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "layers, hidden, heads, key_length, scalar",
    [(18, 640, 4, 256, 256), (62, 5376, 32, 128, 168)],  # gemma-3-270m; gemma-3-27b scales by hidden / heads
)
def test_the_fields_llama_cpp_fixes_for_gemma3(tmp_path, layers, hidden, heads, key_length, scalar):
  path = tmp_path / "meta.gguf"
  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_block_count(layers)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(4 * hidden)
  writer.add_head_count(heads)
  writer.add_head_count_kv(1)
  writer.add_key_length(key_length)
  writer.add_value_length(key_length)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_rope_freq_base(1e6)
  writer.add_sliding_window(512)
  _add_tokenizer(writer, 320, add_bos=None)
  _finish(writer)
  file = gguf_loader.GGUFFile(path)
  config = gguf_loader.gguf_to_hf_config(file)
  assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"]
  assert (config["sliding_window"], config["query_pre_attn_scalar"], config["rope_local_base_freq"]) == (512, scalar, 1e4)
  overrides = hf_config.hf_config_to_overrides(config)
  assert overrides["layer_types"] == [("full" if i % 6 == 5 else "sliding") + "_attention" for i in range(layers)]
  assert (overrides["rope_max_timescale"], overrides["local_rope_max_timescale"]) == (1e6, 1e4)
  assert gguf_loader.load_gguf_tokenizer(file).add_bos_token  # llama.cpp's default for a SentencePiece vocabulary
