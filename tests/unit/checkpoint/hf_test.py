"""Tests of Hugging Face checkpoint loading: parity with transformers, layouts, sharding, prefixes, errors."""

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from maxtext.checkpoint import hf
from maxtext.models import get_flat_params

PROMPT, NEW_TOKENS = 64, 16  # prompt + generation = 80 tokens, across the GDN chunk boundary at 64


def _hf_logits(torch_model, tokens: np.ndarray) -> np.ndarray:
  import torch  # pylint: disable=import-outside-toplevel  # optional test dependency (hf marker)

  with torch.no_grad():
    return torch_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _hf_greedy(torch_model, prompt: np.ndarray, steps: int) -> np.ndarray:
  """transformers greedy decoding (generate, do_sample=False): `[1, P]` -> `[steps]` new tokens."""
  import torch  # pylint: disable=import-outside-toplevel  # optional test dependency (hf marker)

  with torch.no_grad():
    out = torch_model.generate(
        torch.tensor(prompt, dtype=torch.long), do_sample=False, max_new_tokens=steps, min_new_tokens=steps
    )
  return out[0, prompt.shape[1] :].numpy().astype(np.int32)


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _our_greedy(model, prompt: np.ndarray, steps: int) -> list[int]:
  """Greedy decoding by repeated dense forward passes over one fixed-length causal buffer."""
  buf = np.zeros((1, prompt.shape[1] + steps), dtype=np.int32)
  buf[:, : prompt.shape[1]] = prompt
  out = []
  for s in range(steps):
    pos = prompt.shape[1] + s
    logits = np.asarray(_forward(model, jnp.asarray(buf)))
    nxt = int(np.argmax(logits[0, pos - 1]))
    out.append(nxt)
    buf[0, pos] = nxt
  return out


_PARITY_CASES = [
    pytest.param("llama", id="llama-gqa-untied-llama3rope-bias"),
    pytest.param("qwen3_tied", id="qwen3-tied-attention_bias"),
    pytest.param("qwen3_untied", id="qwen3-untied"),
    pytest.param("gemma3", id="gemma3-window16-scalar24-tied"),
    pytest.param("gemma3_softcap", id="gemma3-window3-softcap"),
    pytest.param("qwen3_next_moe", id="qwen3_next-moe", marks=pytest.mark.slow),
    pytest.param("qwen3_next_dense", id="qwen3_next-dense", marks=pytest.mark.slow),
    pytest.param("qwen3_5", id="qwen3_5-flat-gdn", marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe", id="qwen3_5_moe", marks=pytest.mark.slow),
    pytest.param("granite_moe", id="granite4-moe-rope-biases-dtlimit", marks=pytest.mark.slow),
    pytest.param("granite_dense", id="granite4-dense-nope"),
    pytest.param("bamba", id="bamba-partial-rope"),
    pytest.param("gpt_oss", id="gpt_oss-sinks-window8-yarn-biased-moe-clamped-swiglu"),
]


@pytest.mark.hf
@pytest.mark.parametrize("case", _PARITY_CASES)
def test_logits_and_greedy_tokens_match_transformers(case, hf_checkpoint, random_tokens):
  folder, torch_model = hf_checkpoint(case)
  cfg, model = hf.load_hf_model(folder, progress=False)
  prompt = random_tokens(PROMPT)
  generated = _hf_greedy(torch_model, prompt, NEW_TOKENS)
  tokens = np.concatenate([prompt, generated[None]], axis=1)  # [1, 80]
  ours = np.asarray(_forward(model, jnp.asarray(tokens)))
  ref = _hf_logits(torch_model, tokens)
  err = float(np.abs(ours - ref).max())
  print(f"\n{case}: max |logit error| over {tokens.shape[1]} tokens = {err:.2e}")
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  # Our greedy decode by repeated dense forward passes picks, at step s, the argmax of the logits at position
  # PROMPT + s - 1 given the tokens so far; for a causal model those are the logits of this one pass over
  # transformers' greedy sequence, so equal argmaxes at every step is exactly "the 16 greedy tokens match".
  np.testing.assert_array_equal(np.argmax(ours[0, PROMPT - 1 : -1], axis=-1), generated)
  assert cfg.hf_model_path == str(folder)


@pytest.mark.hf
def test_greedy_loop_of_repeated_forward_passes_matches_transformers(hf_checkpoint, random_tokens):
  folder, torch_model = hf_checkpoint("gemma3")
  _, model = hf.load_hf_model(folder, progress=False)
  prompt = random_tokens(8, seed=1)
  assert _our_greedy(model, prompt, NEW_TOKENS) == _hf_greedy(torch_model, prompt, NEW_TOKENS).tolist()


def _params(folder, **overrides):
  cfg = hf.load_hf_config(folder, **overrides)
  return cfg, hf.load_hf_params(folder, cfg)


def _assert_same_params(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for name, value in a.items():
    assert value.dtype == b[name].dtype, name
    np.testing.assert_array_equal(value, b[name], err_msg=name)


@pytest.mark.hf
def test_sharded_checkpoint_loads_like_single_file(hf_checkpoint):
  single, _ = hf_checkpoint("qwen3_next_moe")
  sharded, _ = hf_checkpoint("qwen3_next_moe", max_shard_size="200KB")
  index = json.loads((sharded / "model.safetensors.index.json").read_text(encoding="utf-8"))
  assert len(set(index["weight_map"].values())) > 2
  _assert_same_params(_params(sharded)[1], _params(single)[1])


@pytest.mark.hf
def test_multimodal_prefixes_are_stripped_and_vision_mtp_ignored(hf_checkpoint, tmp_path, rewrite_checkpoint):
  folder, _ = hf_checkpoint("qwen3_5")
  extra = {
      "model.visual.blocks.0.attn.qkv.weight": np.ones((3, 4), np.float32),
      "mtp.fc.weight": np.ones((2, 2), np.float32),
  }

  def to_vlm(raw):
    text = dict(raw, model_type="qwen3_5_text")
    return {"model_type": "qwen3_5", "text_config": text, "vision_config": {}, "tie_word_embeddings": False}

  vlm = tmp_path / "vlm"
  rewrite_checkpoint(
      folder, vlm, rename=lambda n: n.replace("model.", "model.language_model.", 1), add=extra, config=to_vlm
  )
  cfg, params = _params(vlm)
  ref_cfg, ref = _params(folder)
  _assert_same_params(params, ref)
  assert cfg.layer_types == ref_cfg.layer_types and cfg.decoder_block == "qwen3_5"

  gemma, _ = hf_checkpoint("gemma3")
  old = tmp_path / "gemma_vlm"

  def to_gemma_vlm(raw):
    return {"model_type": "gemma3", "text_config": raw, "vision_config": {}}

  extra = {"vision_tower.vision_model.x": np.ones(2, np.float32), "multi_modal_projector.w": np.ones(2, np.float32)}
  rewrite_checkpoint(gemma, old, rename=lambda n: "language_model." + n, add=extra, config=to_gemma_vlm)
  _assert_same_params(_params(old)[1], _params(gemma)[1])


@pytest.mark.hf
def test_legacy_rope_fields_give_the_same_config(hf_checkpoint, tmp_path, rewrite_checkpoint):
  def legacy_llama(raw):
    raw = dict(raw)
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    return raw

  def legacy_gemma(raw):
    raw = dict(raw)
    rope = raw.pop("rope_parameters")
    raw.pop("layer_types")
    raw["sliding_window_pattern"] = 3
    raw["rope_theta"] = rope["full_attention"]["rope_theta"]
    raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    raw["rope_scaling"] = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    return raw

  for case, convert in (("llama", legacy_llama), ("gemma3", legacy_gemma)):
    folder, _ = hf_checkpoint(case)
    legacy = tmp_path / case
    rewrite_checkpoint(folder, legacy, config=convert)
    assert "rope_parameters" not in json.loads((legacy / "config.json").read_text(encoding="utf-8"))
    new_cfg = hf.load_hf_config(folder).as_configdict().to_dict()
    old_cfg = hf.load_hf_config(legacy, hf_model_path=str(folder)).as_configdict().to_dict()
    assert old_cfg == new_cfg


@pytest.mark.hf
def test_bfloat16_checkpoint_and_weight_dtype_cast(hf_checkpoint, tmp_path):
  import torch  # pylint: disable=import-outside-toplevel  # optional test dependency (hf marker)

  _, torch_model = hf_checkpoint("qwen3_untied")
  folder = tmp_path / "bf16"
  torch_model.to(torch.bfloat16).save_pretrained(str(folder))
  torch_model.to(torch.float32)
  embed = torch_model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
  cfg, params = _params(folder, weight_dtype="bfloat16")
  assert cfg.weight_dtype == "bfloat16"
  assert params["embedder.embedding"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(params["embedder.embedding"].astype(np.float32), embed)
  _, params32 = _params(folder)
  assert params32["lm_head.kernel"].dtype == np.float32
  np.testing.assert_array_equal(params32["embedder.embedding"], embed)
  # float32 checkpoint -> bfloat16 parameters rounds to nearest
  src, _ = hf_checkpoint("qwen3_untied")
  _, rounded = _params(src, weight_dtype="bfloat16")
  full = torch_model.model.embed_tokens.weight.detach().numpy()
  np.testing.assert_array_equal(rounded["embedder.embedding"], full.astype(ml_dtypes.bfloat16))


@pytest.mark.hf
def test_fused_expert_layout_loads_like_per_expert_keys(hf_checkpoint, tmp_path):
  from safetensors.torch import save_file as save_torch  # pylint: disable=import-outside-toplevel  # hf extra

  folder, torch_model = hf_checkpoint("qwen3_5_moe")
  state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
  assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 64)  # in-memory transformers 5 layout
  fused = tmp_path / "fused"
  fused.mkdir()
  save_torch(state, str(fused / "model.safetensors"))
  shutil.copy(folder / "config.json", fused / "config.json")
  _assert_same_params(_params(fused)[1], _params(folder)[1])


@pytest.mark.hf
def test_tied_checkpoint_with_lm_head_ignores_it(hf_checkpoint, tmp_path, rewrite_checkpoint):
  folder, _ = hf_checkpoint("qwen3_tied")
  out = tmp_path / "with_head"
  rewrite_checkpoint(folder, out, add={"lm_head.weight": np.zeros((512, 64), np.float32)})
  cfg, params = _params(out)
  assert cfg.logits_via_embedding and "lm_head.kernel" not in params
  _assert_same_params(params, _params(folder)[1])


@pytest.mark.hf
def test_progress_bar_goes_to_stderr(hf_checkpoint, capsys):
  folder, _ = hf_checkpoint("qwen3_untied")
  cfg = hf.load_hf_config(folder)
  names = [name for name, _ in hf.iter_hf_params(folder, cfg, progress=True)]
  captured = capsys.readouterr()
  assert f"Loading {folder.name}" in captured.err and captured.out == ""
  assert sorted(names) == sorted(get_flat_params(hf.load_hf_model(folder, progress=False)[1]))


@pytest.mark.hf
def test_overrides_win_over_config_json(hf_checkpoint):
  folder, _ = hf_checkpoint("qwen3_untied")
  cfg = hf.load_hf_config(folder, ["head_dim=16"], vocab_size=1024, dtype="bfloat16")
  assert (cfg.head_dim, cfg.vocab_size, cfg.dtype, cfg.base_emb_dim) == (16, 1024, "bfloat16", 64)
  with pytest.raises(
      ValueError,
      match=r"tensor 'model.embed_tokens.weight' \(canonical embedder.embedding\) in model.safetensors has shape "
      r"\(512, 64\), but the config expects \(1024, 64\)",
  ):
    hf.iter_hf_params(folder, cfg)


@pytest.mark.hf
@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"drop": ("model.layers.1.self_attn.k_proj.weight",)},
            r"is missing 1 tensors: 'model.layers.1.self_attn.k_proj.weight' \(canonical layers.1.attn.k.kernel, "
            r"expected shape \(64, 64\)\)",
        ),
        (
            {"add": {"model.layers.0.mlp.extra.weight": np.ones((2, 3), np.float32)}},
            r"has 1 unexpected tensors that a decoder_block='qwen3' model with this config does not use: "
            r"'model.layers.0.mlp.extra.weight' \(shape \(2, 3\)\)",
        ),
        (
            {"add": {"model.layers.0.self_attn.q_proj.weight": np.ones((127, 64), np.float32)}},
            r"tensor 'model.layers.0.self_attn.q_proj.weight' \(canonical layers.0.attn.q.kernel\) in "
            r"model.safetensors has shape \(127, 64\), but the config expects \(128, 64\)",
        ),
        (
            {"add": {"model.layers.0.self_attn.q_norm.weight": np.ones(32, np.int32)}},
            r"tensor 'model.layers.0.self_attn.q_norm.weight' in model.safetensors has dtype I32; weights must be one "
            r"of F64, F32, F16, BF16",
        ),
        (
            {"add": {"model.language_model.norm.weight": np.ones(64, np.float32)}},
            r"tensor 'model.norm.weight' in model.safetensors and 'model.language_model.norm.weight' in "
            r"model.safetensors both map to 'model.norm.weight'",
        ),
    ],
)
def test_checkpoint_errors_name_the_tensor(edit, match, hf_checkpoint, tmp_path, rewrite_checkpoint):
  folder, _ = hf_checkpoint("qwen3_untied")
  bad = tmp_path / "bad"
  rewrite_checkpoint(folder, bad, **edit)
  cfg = hf.load_hf_config(bad)
  with pytest.raises(ValueError, match=match):
    list(hf.iter_hf_params(bad, cfg))


@pytest.mark.hf
def test_many_missing_tensors_are_summarised(hf_checkpoint, tmp_path, rewrite_checkpoint):
  folder, _ = hf_checkpoint("qwen3_untied")
  bad = tmp_path / "bad"
  rewrite_checkpoint(folder, bad, rename=lambda n: n.replace("mlp.", "ffn."))
  with pytest.raises(ValueError, match=r"is missing 6 tensors: .* and 1 more"):
    hf.iter_hf_params(bad, hf.load_hf_config(bad))


def test_missing_folder_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"folder '.*nowhere' does not exist"):
    hf.load_hf_config(tmp_path / "nowhere")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 1}), encoding="utf-8")
  cfg = hf.load_hf_config(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors files"):
    hf.iter_hf_params(tmp_path, cfg)
  with pytest.raises(FileNotFoundError, match=r"folder '.*nowhere' does not exist"):
    hf.iter_hf_params(tmp_path / "nowhere", cfg)


def test_unsupported_model_type(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}), encoding="utf-8")
  with pytest.raises(NotImplementedError, match=r"model_type 'mixtral' is not supported"):
    hf.load_hf_model(tmp_path)


def test_sharded_index_errors(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}), encoding="utf-8")
  cfg = hf.load_hf_config(tmp_path, vocab_size=8, base_emb_dim=4, base_num_query_heads=1, base_num_kv_heads=1)
  index = tmp_path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}), "utf-8")
  with pytest.raises(FileNotFoundError, match=r"lists 'model-00001-of-00002.safetensors', which is not in"):
    hf.iter_hf_params(tmp_path, cfg)
  index.write_text(json.dumps({"metadata": {}}), encoding="utf-8")
  with pytest.raises(ValueError, match=r"index.json must have a non-empty 'weight_map' object"):
    hf.iter_hf_params(tmp_path, cfg)


def test_gated_attention_with_bias_is_rejected(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 1}), encoding="utf-8")
  save_file({"model.norm.weight": np.ones(4, np.float32)}, str(tmp_path / "model.safetensors"))
  cfg = hf.load_hf_config(tmp_path, decoder_block="qwen3_next", attention_bias=True, layer_types=["full_attention"])
  with pytest.raises(
      NotImplementedError,
      match=r"layer 0: attention_bias with the gated attention of " r"decoder_block='qwen3_next' is not supported",
  ):
    hf.iter_hf_params(tmp_path, cfg)
