"""GGUF loading on small synthetic files written with `gguf.GGUFWriter`: config, parameters, dequantization,
tokenizer, and the errors of a truncated file, an unknown or unsupported tensor type and an unsupported architecture.

Expected values never come from the loader: weights are written from known arrays (llama.cpp's Q/K row permutation
applied here, as its converter does), quantized tensors are compared with `gguf.quants`' own round trip and with the
original values within each type's quantization error (K-quants, which `gguf` cannot quantize, are random valid blocks
compared with `gguf.quants.dequantize`), and canonical layouts are spelled out with numpy.
"""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

import gguf_blocks
from maxtext import decode
from maxtext.checkpoint import gguf as gguf_loader
from maxtext.checkpoint import load_model, load_run_config, source
from maxtext.configs import ConfigError, load_config
from maxtext.inference.tokenizer import HFTokenizer, tokenizer_from_config

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

D, LAYERS, HQ, HKV, DH, FF = 64, 2, 4, 2, 16, 96
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> list[str]:
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  return SPECIALS + alphabet + ["he", "ll", "hell", "Ġw", "or", "Ġwor"]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """What llama.cpp's converter does to q_proj / k_proj rows (its rope pairs adjacent elements)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(rng: np.random.Generator, vocab: int, qwen3: bool) -> dict[str, np.ndarray]:
  """Hugging Face named float32 weights of a tiny Llama / Qwen3 (tied embeddings)."""

  def normal(*shape):
    return rng.standard_normal(shape).astype(np.float32) * 0.1

  weights = {"model.embed_tokens.weight": normal(vocab, D), "model.norm.weight": 1 + normal(D)}
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    weights |= {
        p + "input_layernorm.weight": 1 + normal(D),
        p + "post_attention_layernorm.weight": 1 + normal(D),
        p + "self_attn.q_proj.weight": normal(HQ * DH, D),
        p + "self_attn.k_proj.weight": normal(HKV * DH, D),
        p + "self_attn.v_proj.weight": normal(HKV * DH, D),
        p + "self_attn.o_proj.weight": normal(D, HQ * DH),
        p + "mlp.gate_proj.weight": normal(FF, D),
        p + "mlp.up_proj.weight": normal(FF, D),
        p + "mlp.down_proj.weight": normal(D, FF),
    }
    if qwen3:
      weights |= {p + "self_attn.q_norm.weight": 1 + normal(DH), p + "self_attn.k_norm.weight": 1 + normal(DH)}
  return weights


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
  if hf_name == "model.embed_tokens.weight":
    return "token_embd.weight"
  if hf_name == "model.norm.weight":
    return "output_norm.weight"
  _, _, i, rest = hf_name.split(".", 3)
  return f"blk.{i}.{_TO_GGUF[rest]}"


def write_model(
    path, arch="llama", weights=None, seed=0, quant=None, tokenizer_model="gpt2", template=TEMPLATE, extra_tokens=0
):
  """Writes a tiny model GGUF (its vocabulary grown by `extra_tokens` plain tokens); returns its Hugging Face
  weights (before quantization)."""
  vocab = _vocab() + [f"<extra_{i}>" for i in range(extra_tokens)]
  weights = weights if weights is not None else _hf_weights(np.random.default_rng(seed), len(vocab), arch == "qwen3")
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(LAYERS)
  writer.add_context_length(512)
  writer.add_embedding_length(D)
  writer.add_feed_forward_length(FF)
  writer.add_head_count(HQ)
  writer.add_head_count_kv(HKV)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(50000.0)
  writer.add_rope_dimension_count(DH)
  if arch == "qwen3":
    writer.add_key_length(DH)
    writer.add_value_length(DH)
  writer.add_tokenizer_model(tokenizer_model)
  writer.add_tokenizer_pre("default")
  writer.add_token_list(vocab)
  writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(True)
  if template:
    writer.add_chat_template(template)
  for name, array in weights.items():
    heads = {"q_proj": HQ, "k_proj": HKV}.get(name.split(".")[-2]) if arch == "llama" else None
    stored = _llama_cpp_permute(array, heads) if heads else array
    if quant is not None and stored.ndim == 2:
      writer.add_tensor(_gguf_name(name), gguf.quants.quantize(stored, quant), raw_dtype=quant)
    else:
      writer.add_tensor(_gguf_name(name), stored)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return weights


@pytest.fixture(name="llama_file")
def fixture_llama_file(tmp_path):
  path = tmp_path / "tiny-llama.gguf"
  return path, write_model(path)


def test_the_config_comes_from_the_metadata(llama_file):
  path, _ = llama_file
  cfg = gguf_loader.load_gguf_config(path, ["max_target_length=64"])
  got = {
      k: cfg[k]
      for k in (
          "decoder_block",
          "base_emb_dim",
          "base_num_decoder_layers",
          "base_num_query_heads",
          "base_num_kv_heads",
          "head_dim",
          "base_mlp_dim",
          "vocab_size",
          "logits_via_embedding",
          "rope_max_timescale",
          "max_target_length",
          "gguf_model_path",
      )
  }
  assert got == {
      "decoder_block": "llama2",
      "base_emb_dim": D,
      "base_num_decoder_layers": LAYERS,
      "base_num_query_heads": HQ,
      "base_num_kv_heads": HKV,
      "head_dim": DH,
      "base_mlp_dim": FF,
      "vocab_size": len(_vocab()),
      "logits_via_embedding": True,
      "rope_max_timescale": 50000.0,
      "max_target_length": 64,
      "gguf_model_path": str(path),
  }
  assert cfg.normalization_layer_epsilon == pytest.approx(1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parameters_undo_the_layout_and_llama_cpp_row_permutation(tmp_path, arch):
  path = tmp_path / f"{arch}.gguf"
  hf = write_model(path, arch=arch, seed=1)
  cfg = gguf_loader.load_gguf_config(path)
  assert cfg.decoder_block == ("qwen3" if arch == "qwen3" else "llama2") and cfg.use_qk_norm == (arch == "qwen3")
  params = dict(gguf_loader.iter_gguf_params(path, cfg))
  p = "model.layers.1."
  np.testing.assert_array_equal(params["embedder.embedding"], hf["model.embed_tokens.weight"])
  np.testing.assert_array_equal(params["layers.1.attn.q.kernel"], hf[p + "self_attn.q_proj.weight"].T.reshape(D, HQ, DH))
  np.testing.assert_array_equal(params["layers.1.attn.k.kernel"], hf[p + "self_attn.k_proj.weight"].T.reshape(D, HKV, DH))
  np.testing.assert_array_equal(params["layers.1.attn.o.kernel"], hf[p + "self_attn.o_proj.weight"].T.reshape(HQ, DH, D))
  np.testing.assert_array_equal(params["layers.1.mlp.down.kernel"], hf[p + "mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(params["layers.1.pre_mlp_norm.scale"], hf[p + "post_attention_layernorm.weight"])
  if arch == "qwen3":
    np.testing.assert_array_equal(params["layers.1.attn.k_norm.scale"], hf[p + "self_attn.k_norm.weight"])
  assert "lm_head.kernel" not in params and all(a.dtype == np.float32 for a in params.values())


def test_bfloat16_weights_and_load_model(llama_file):
  path, hf = llama_file
  cfg = load_run_config(gguf_model_path=str(path), weight_dtype="bfloat16")
  model = load_model(cfg, progress=False)
  embedding = np.asarray(model.embedder.embedding[...])
  assert embedding.dtype.name == "bfloat16"
  np.testing.assert_allclose(embedding.astype(np.float32), hf["model.embed_tokens.weight"], rtol=1e-2, atol=1e-3)


# (type, max |error| relative to the largest |value| of a block of 32)
QUANT_TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 1.0 / 127,
    "Q5_0": 1.0 / 15,
    "Q5_1": 1.0 / 31,
    "Q4_0": 1.0 / 7,
    "Q4_1": 1.0 / 15,
}


def test_every_supported_type_is_tested():
  assert set(QUANT_TOLERANCE) | set(gguf_blocks.K_QUANTS) == set(gguf_loader.SUPPORTED_TENSOR_TYPES)


@pytest.mark.parametrize("type_name", gguf_blocks.K_QUANTS[:-1])
def test_k_quant_tensors_load_as_gguf_dequantizes_them_in_float32_and_bfloat16(tmp_path, type_name):
  """K-quants (random valid blocks: the gguf library cannot quantize them) through the loader; gguf_format_test
  compares every K-quant bit for bit."""
  qtype = gguf.GGMLQuantizationType[type_name]
  raw = gguf_blocks.random_k_blocks(type_name, (6, 512), np.random.default_rng(4))
  path = tmp_path / f"{type_name}.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tensor("t", raw, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  file = gguf_loader.GGUFFile(path)
  assert file.tensors["t"].shape == (6, 512) and file.tensors["t"].type_name == type_name
  expected = gguf.quants.dequantize(raw, qtype)
  assert np.array_equal(file.read("t"), expected)
  got = file.read("t", ml_dtypes.bfloat16)
  assert np.array_equal(got.view(np.uint16), expected.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("type_name", sorted(QUANT_TOLERANCE))
def test_dequantization_matches_gguf_reference_and_the_original_values(tmp_path, type_name):
  qtype = gguf.GGMLQuantizationType[type_name]
  rng = np.random.default_rng(7)
  x = rng.standard_normal((6, 96)).astype(np.float32)  # [out, in]: gguf lists the dims as (96, 6)
  path = tmp_path / f"{type_name}.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  if qtype == gguf.GGMLQuantizationType.F32:
    writer.add_tensor("t", x)
  elif qtype == gguf.GGMLQuantizationType.F16:
    writer.add_tensor("t", x.astype(np.float16))
  else:
    writer.add_tensor("t", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  file = gguf_loader.GGUFFile(path)
  assert file.tensors["t"].shape == (6, 96) and file.tensors["t"].type_name == type_name
  got = file.read("t")
  reference = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
  np.testing.assert_array_equal(got, np.asarray(reference, np.float32).reshape(6, 96))
  block_max = np.abs(x).reshape(6, 3, 32).max(axis=-1, keepdims=True)
  error = np.abs(got - x).reshape(6, 3, 32)
  assert np.all(error <= QUANT_TOLERANCE[type_name] * block_max + 1e-7)


def test_a_quantized_model_loads_with_the_permutation_applied_after_dequantization(tmp_path):
  path = tmp_path / "q8.gguf"
  hf = write_model(path, quant=gguf.GGMLQuantizationType.Q8_0, seed=2)
  cfg = gguf_loader.load_gguf_config(path)
  params = dict(gguf_loader.iter_gguf_params(path, cfg))
  q = hf["model.layers.0.self_attn.q_proj.weight"]
  expected = gguf.quants.dequantize(gguf.quants.quantize(_llama_cpp_permute(q, HQ), gguf.GGMLQuantizationType.Q8_0), 8)
  unpermuted = expected.reshape(HQ, DH // 2, 2, D).swapaxes(1, 2).reshape(HQ * DH, D)
  np.testing.assert_array_equal(params["layers.0.attn.q.kernel"], unpermuted.T.reshape(D, HQ, DH))
  np.testing.assert_allclose(params["layers.0.attn.q.kernel"], q.T.reshape(D, HQ, DH), atol=np.abs(q).max() / 127)


def test_a_truncated_file_is_one_clear_error(llama_file, tmp_path):
  path, _ = llama_file
  data = path.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: len(data) - 100])
  expected = r"not a readable GGUF file \({} bytes; truncated or corrupt\? download it again\)"
  with pytest.raises(gguf_loader.GGUFError, match=expected.format(len(data) - 100)):
    gguf_loader.GGUFFile(cut)
  cut.write_bytes(data[:300])  # inside the metadata
  with pytest.raises(gguf_loader.GGUFError, match=expected.format(300)):
    gguf_loader.GGUFFile(cut)


def _set_tensor_type(path, tensor: str, type_id: int) -> None:
  """Overwrites the type id in the tensor-info record of `tensor` (name, n_dims u32, dims u64 each, type u32)."""
  data = bytearray(path.read_bytes())
  name = tensor.encode()
  at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
  n_dims = struct.unpack_from("<I", data, at)[0]
  struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
  path.write_bytes(bytes(data))


def test_an_unknown_tensor_type_is_one_clear_error(llama_file):
  path, _ = llama_file
  _set_tensor_type(path, "output_norm.weight", 250)
  with pytest.raises(gguf_loader.GGUFError, match="a tensor has an unknown tensor type .*250"):
    gguf_loader.GGUFFile(path)


def test_an_unsupported_quantization_type_names_the_tensor_and_type(tmp_path):
  path = tmp_path / "iq2.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS][1]
  writer.add_tensor(
      "blk.0.ffn_up.weight", np.zeros((2, block_bytes), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS
  )
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  file = gguf_loader.GGUFFile(path)  # the header and the metadata (a tokenizer) are still readable
  assert [t.gguf_name for t in file.unsupported] == ["blk.0.ffn_up.weight"]
  expected = (
      r"tensor 'blk.0.ffn_up.weight' has quantization type IQ2_XXS, which is not supported \(supported: F32, F16,"
      r" BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K\)$"
  )
  with pytest.raises(NotImplementedError, match=expected):
    gguf_loader.check_loadable(file)
  with pytest.raises(NotImplementedError, match=expected):
    file.read("model.layers.0.mlp.up_proj.weight")


def test_streaming_the_weights_checks_the_tensor_types_first(llama_file, tmp_path):
  path, _ = llama_file
  cfg = gguf_loader.load_gguf_config(path)
  other = tmp_path / "iq3.gguf"  # another path: open_gguf's cache keeps the first file
  other.write_bytes(path.read_bytes())
  _set_tensor_type(other, "blk.1.ffn_down.weight", gguf.GGMLQuantizationType.IQ3_S)
  with pytest.raises(NotImplementedError, match=r"^\S*iq3.gguf: tensor 'blk.1.ffn_down.weight' has .* type IQ3_S"):
    gguf_loader.iter_gguf_params(other, cfg)


def test_an_unsupported_architecture_and_tensor_types_are_one_error_naming_them_all(tmp_path):
  path = tmp_path / "gemma2.gguf"
  write_model(path, arch="gemma2")
  iq2, iq4 = gguf.GGMLQuantizationType.IQ2_XXS, gguf.GGMLQuantizationType.IQ4_NL
  _set_tensor_type(path, "blk.0.attn_output.weight", iq2)
  _set_tensor_type(path, "blk.0.ffn_up.weight", iq4)
  _set_tensor_type(path, "blk.1.attn_output.weight", iq2)
  expected = (
      r"gemma2.gguf: GGUF architecture 'gemma2' is not supported \(supported: gemma3, llama, qwen3\); and 2 tensors"
      r" \('blk.0.attn_output.weight', 'blk.1.attn_output.weight'\) have quantization type IQ2_XXS, tensor"
      r" 'blk.0.ffn_up.weight' has quantization type IQ4_NL, which are not supported \(supported: F32, F16, .*,"
      r" Q8_K\)$"
  )
  with pytest.raises(NotImplementedError, match=expected):
    gguf_loader.load_gguf_config(path)


def test_unsupported_architecture_and_missing_file(tmp_path):
  path = tmp_path / "other.gguf"
  write_model(path, arch="gemma2")
  with pytest.raises(NotImplementedError, match="GGUF architecture 'gemma2' is not supported"):
    gguf_loader.load_gguf_config(path)
  with pytest.raises(FileNotFoundError, match="fetch_example_model.py"):
    gguf_loader.load_gguf_config(tmp_path / "absent.gguf")
  with pytest.raises(gguf_loader.GGUFError, match=r"is a folder, not a GGUF file; .* it holds other.gguf$"):
    gguf_loader.load_gguf_config(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
  weights = _hf_weights(np.random.default_rng(3), len(_vocab()), qwen3=False)
  del weights["model.layers.1.mlp.up_proj.weight"]
  path = tmp_path / "missing.gguf"
  write_model(path, weights=weights)
  cfg = gguf_loader.load_gguf_config(path)
  with pytest.raises(gguf_loader.GGUFError, match=r"missing 1 tensors .*model.layers.1.mlp.up_proj.weight"):
    gguf_loader.iter_gguf_params(path, cfg)
  path = tmp_path / "extra.gguf"
  write_model(path, weights=_hf_weights(np.random.default_rng(4), len(_vocab()), qwen3=True))  # llama: no qk norm
  cfg = gguf_loader.load_gguf_config(path)
  with pytest.raises(gguf_loader.GGUFError, match=r"4 tensors this model does not use: 'blk.0.attn_k_norm.weight'"):
    gguf_loader.iter_gguf_params(path, cfg)


def test_prompt_token_ids_are_checked_against_the_files_vocabulary(tmp_path, capsys):
  path = tmp_path / "wide-vocab.gguf"
  write_model(path, extra_tokens=400)
  vocab = len(_vocab()) + 400
  assert load_config().vocab_size < 600 < vocab  # id 600 is valid only with the file's vocabulary
  cfg = load_run_config([f"gguf_model_path={path}", "prompt_token_ids=[1, 600, 5]"])
  assert cfg.vocab_size == vocab and tuple(cfg.prompt_token_ids) == (1, 600, 5)
  with pytest.raises(ConfigError, match=rf"token {vocab} must be in \[0, vocab_size={vocab}\)"):
    load_run_config([f"gguf_model_path={path}", f"prompt_token_ids=[1, {vocab}]"])
  # The reported command: a model YAML that names a GGUF file, token ids beyond base.yml's vocabulary.
  args = ["model_name=smollm2-135m-instruct", f"gguf_model_path={path}", "prompt_token_ids=[1, 600, 5]"]
  assert decode.main(args + ["max_new_tokens=2", "max_target_length=16", "output_format=json"]) == 0, capsys.readouterr()
  (request,) = json.loads(capsys.readouterr().out)["requests"]
  assert request["prompt_token_ids"] == [1, 600, 5] and 1 <= len(request["output_token_ids"]) <= 2


def test_hf_and_gguf_paths_together_are_refused(llama_file, tmp_path):
  path, _ = llama_file
  with pytest.raises(
      ConfigError,
      match="a keyword argument sets hf_model_path=.* and gguf_model_path=.*; a run takes its model from one source",
  ):
    load_run_config(gguf_model_path=str(path), hf_model_path=str(tmp_path))


def test_the_tokenizer_comes_from_the_vocabulary_and_merges(llama_file):
  path, _ = llama_file
  cfg = load_run_config(gguf_model_path=str(path))
  tokenizer = tokenizer_from_config(cfg)
  vocab = _vocab()
  ids = tokenizer.encode("hello world<|im_end|>", add_bos=True)
  # bos (add_bos_token), "hell" + "o" by the merges, "Ġwor" + "l" + "d", the control token whole.
  assert [vocab[i] for i in ids] == ["<|im_start|>", "hell", "o", "Ġwor", "l", "d", "<|im_end|>"]
  assert tokenizer.decode(ids) == "hello world"
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, len(vocab))
  assert tokenizer.chat_template == TEMPLATE and tokenizer.token_text(1) == "<|im_start|>"


def test_the_gguf_source_supplies_model_keys_tensors_tokenizer_and_template(llama_file):
  path, weights = llama_file
  gguf_file = source.open_source("gguf_model_path", str(path))
  keys = gguf_file.model_keys()
  assert (keys["decoder_block"], keys["base_emb_dim"], keys["base_num_decoder_layers"]) == ("llama2", D, LAYERS)
  assert "gguf_model_path" not in keys
  cfg = gguf_file.load_config()
  assert cfg.gguf_model_path == str(path)
  streamed = dict(gguf_file.iter_params(cfg))
  np.testing.assert_array_equal(streamed["embedder.embedding"], weights["model.embed_tokens.weight"])
  files = gguf_file.tokenizer()
  assert files.path == str(path) and files.parts.eos_token_id == 2
  assert gguf_file.chat_template() == TEMPLATE
  assert gguf_file.tokenizer_keys() == {"gguf_model_path": str(path)}


@pytest.mark.parametrize(
    "model, match",
    [
        ("t5", r"tokenizer.ggml.model='t5' is not supported \(byte-level BPE 'gpt2', SentencePiece 'llama'\)"),
        ("llama", r"supported without a space prefix only \(tokenizer.ggml.add_space_prefix=false"),
    ],
)
def test_an_unsupported_tokenizer_model_is_named(tmp_path, model, match):
  path = tmp_path / "spm.gguf"
  write_model(path, tokenizer_model=model)
  with pytest.raises(NotImplementedError, match=match):
    HFTokenizer.from_gguf(str(path))


@pytest.mark.slow
def test_llm_renders_the_files_chat_template_and_decodes(tmp_path, llama_file):
  from maxtext.inference import LLM, SamplingParams  # pylint: disable=import-outside-toplevel  # a higher layer

  path, _ = llama_file
  llm = LLM(gguf_model_path=str(path), use_chat_template=True, max_target_length=64, num_kv_blocks=16)
  out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3))[0]
  vocab = _vocab()
  # bos_token (<|im_start|>) from the template itself, then the turn; no second bos is added.
  expected = ["<|im_start|>", "<|im_start|>", "u", "s", "e", "r", "Ċ", "hell", "o", "<|im_end|>", "Ċ", "<|im_start|>"]
  expected += ["a", "s", "s", "i", "s", "t", "a", "n", "t", "Ċ"]
  assert [vocab[i] for i in out.prompt_token_ids] == expected
  assert len(out.outputs[0].token_ids) >= 1
  plain = LLM(gguf_model_path=str(path), max_target_length=64, num_kv_blocks=16)
  assert plain.generate("hello", SamplingParams(temperature=0.0, max_tokens=1))[0].prompt_token_ids == [
      1,
      vocab.index("hell"),
      vocab.index("o"),
  ]
  path_without = tmp_path / "no-template.gguf"
  write_model(path_without, template=None)
  with pytest.raises(ValueError, match="use_chat_template=true but .*no-template.gguf has no chat template"):
    LLM(gguf_model_path=str(path_without), use_chat_template=True, max_target_length=64).generate("hi")


def test_the_converter_writes_an_orbax_copy_that_decodes_with_the_files_tokenizer(llama_file, tmp_path, capsys):
  from maxtext.checkpoint import convert  # pylint: disable=import-outside-toplevel  # the converter's own module

  path, _ = llama_file
  out = tmp_path / "converted"
  assert convert.main(["--gguf_model_path", str(path), "--output_dir", str(out), "--no_progress"]) == 0
  assert capsys.readouterr().out.startswith(f"wrote {out / 'params'}")
  cfg = convert.load_converted_config(out)
  assert (cfg.load_parameters_path, cfg.gguf_model_path) == (str(out / "params"), str(path))
  restored = load_model(cfg)
  expected = dict(gguf_loader.iter_gguf_params(path, gguf_loader.load_gguf_config(path)))
  np.testing.assert_array_equal(np.asarray(restored.layers[1].attn.q.kernel[...]), expected["layers.1.attn.q.kernel"])
  assert tokenizer_from_config(cfg).chat_template == TEMPLATE
  with pytest.raises(ValueError, match="exactly one of hf_model_path and gguf_model_path"):
    convert.convert(None, tmp_path / "x")


def test_the_converted_yaml_is_a_config_that_decodes_as_the_file_does(llama_file, tmp_path, capsys):
  from maxtext.checkpoint import convert  # pylint: disable=import-outside-toplevel  # the converter's own module

  path, _ = llama_file
  out = tmp_path / "converted"
  argv = ["--gguf_model_path", str(path), "--output_dir", str(out), "--weight_dtype", "bfloat16", "--no_progress"]
  assert convert.main(argv) == 0
  capsys.readouterr()
  run = ["prompt_token_ids=[1, 5, 6]", "max_new_tokens=4", "output_format=json", "max_target_length=32"]
  assert decode.main([str(out / "maxtext_model.yml")] + run) == 0, capsys.readouterr().err
  (converted,) = json.loads(capsys.readouterr().out)["requests"]
  assert decode.main([f"gguf_model_path={path}", "weight_dtype=bfloat16"] + run) == 0, capsys.readouterr().err
  (direct,) = json.loads(capsys.readouterr().out)["requests"]
  assert converted["output_token_ids"] == direct["output_token_ids"] and len(direct["output_token_ids"]) == 4
  cfg = convert.load_converted_config(out)
  assert (cfg.weight_dtype, cfg.load_parameters_path) == ("bfloat16", str(out / "params"))


def _metadata_file(path, arch="llama", drop=(), extra=None, tensors=(), pre="default", merges=True, tokens=True):
  """A GGUF with the tiny model's metadata (minus `drop`, plus `extra` {key: value}) and the given 1-D tensors."""
  writer = gguf.GGUFWriter(str(path), arch)
  values = {
      f"{arch}.block_count": LAYERS,
      f"{arch}.embedding_length": D,
      f"{arch}.feed_forward_length": FF,
      f"{arch}.attention.head_count": HQ,
      f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
  }
  values.update(extra or {})
  for key, value in values.items():
    if key in drop:
      continue
    if isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, list):
      writer.add_array(key, value)
    elif isinstance(value, float):
      writer.add_float32(key, value)
    else:
      writer.add_uint32(key, value)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  if tokens:
    writer.add_token_list(_vocab() + ["12"])
  if merges:
    writer.add_token_merges(MERGES + ["1 2"])
  for name in tensors:
    writer.add_tensor(name, np.ones(4, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"drop": ("llama.block_count",)}, gguf_loader.GGUFError, "metadata llama.block_count is missing"),
        ({"extra": {"llama.attention.head_count": [4, 8]}}, NotImplementedError, r"differs between layers \(\[4, 8\]\)"),
        ({"extra": {"llama.rope.dimension_count": 8}}, NotImplementedError, "rope.dimension_count=8; .*full rotary"),
        ({"tensors": ("rope_freqs.weight",)}, NotImplementedError, "rope frequency factors"),
        ({"tokens": False}, gguf_loader.GGUFError, "neither llama.vocab_size nor tokenizer.ggml.tokens is set"),
        (
            {"extra": {"llama.rope.scaling.type": "yarn"}},
            NotImplementedError,
            "rope.scaling.type='yarn' is not supported",
        ),
    ],
    ids=["missing-key", "per-layer-heads", "partial-rope", "rope-freqs", "no-vocab", "yarn"],
)
def test_metadata_errors_name_the_key(tmp_path, kwargs, error, match):
  with pytest.raises(error, match=match):
    gguf_loader.gguf_to_hf_config(gguf_loader.GGUFFile(_metadata_file(tmp_path / "m.gguf", **kwargs)))


def test_uniform_per_layer_heads_and_linear_rope_scaling(tmp_path):
  extra = {"llama.attention.head_count": [HQ, HQ], "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
  config = gguf_loader.gguf_to_hf_config(gguf_loader.GGUFFile(_metadata_file(tmp_path / "m.gguf", extra=extra)))
  assert config["num_attention_heads"] == HQ and config["num_key_value_heads"] == HQ
  assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
  assert config["vocab_size"] == len(_vocab()) + 1 and config["head_dim"] == D // HQ


@pytest.mark.parametrize(
    "pre, digits", [("default", ["12"]), ("smollm", ["1", "2"]), ("qwen2", ["1", "2"]), ("llama-bpe", ["12"])]
)
def test_pre_tokenizers_split_digits_as_their_vocabularies_expect(tmp_path, pre, digits):
  tokenizer = gguf_loader.load_gguf_tokenizer(_metadata_file(tmp_path / "m.gguf", pre=pre)).tokenizer
  assert tokenizer.encode("12", add_special_tokens=False).tokens == digits
  assert tokenizer.encode("hello world", add_special_tokens=False).tokens == ["hell", "o", "Ġwor", "l", "d"]


def test_tokenizer_metadata_errors(tmp_path):
  with pytest.raises(NotImplementedError, match="tokenizer.ggml.pre='tekken' is not supported"):
    gguf_loader.load_gguf_tokenizer(_metadata_file(tmp_path / "a.gguf", pre="tekken"))
  with pytest.raises(gguf_loader.GGUFError, match="tokenizer.ggml.tokens and tokenizer.ggml.merges must both be set"):
    gguf_loader.load_gguf_tokenizer(_metadata_file(tmp_path / "b.gguf", merges=False))
