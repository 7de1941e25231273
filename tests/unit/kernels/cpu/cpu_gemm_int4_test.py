"""Int4 column panels, a tied head's coarse copy (`greedy_head_candidates`): the packed format against a NumPy
reading of its documented layout, the kernel against float64 over the dequantized weights, the candidates' logits
against the table's rows, the greedy pick against the whole head's, the `cpu` backend's copy and the config key."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maxtext.configs import load_config
from maxtext.configs.errors import ConfigError
from maxtext.inference import LLM, SamplingParams
from maxtext.kernels import backend as kernel_backend
from maxtext.kernels.cpu import backend as cpu_backend
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import CpuBackend
from maxtext.layers import embeddings

needs_int4 = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None or cpu_gemm.int8_dot_reason() is not None,
    reason="int4 panels are read with AVX-512 VNNI and VBMI's integer products",
)


def _rounded(x: np.ndarray) -> np.ndarray:
  """x as the integer products read it (`cpu/int8_dot.h`): per row and block of 32, q = round(x / amax * 32639)."""
  x = np.asarray(x, np.float32)
  blocks = x.reshape(x.shape[0], -1, 32)
  amax = np.max(np.abs(blocks), axis=2, keepdims=True)
  levels = np.float32(cpu_gemm.INT8_DOT_LEVELS)
  with np.errstate(divide="ignore", invalid="ignore"):
    q = np.where(amax > 0, np.rint((blocks * (np.float32(1) / amax) * levels).astype(np.float32)), 0)
  return (q * (amax.astype(np.float64) / np.float64(levels))).reshape(x.shape)


def _unpack(panels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """q [T, B, 32 rows, 32 columns] and float16 scales [T, B, 32] of int4 panels, read byte by byte as the format is
  documented: group g's byte i holds byte i of rows 4g, 4g+1 (low nibble) and of rows 4g+2, 4g+3 (high nibble)."""
  count, blocks, _ = panels.shape
  q = np.zeros((count, blocks, 32, 32), np.int64)
  for g in range(8):
    for i in range(64):
      byte = panels[:, :, g * 64 + i].astype(np.int64)
      q[:, :, 4 * g + i // 32, i % 32] = (byte & 15) - 8
      q[:, :, 4 * g + 2 + i // 32, i % 32] = (byte >> 4) - 8
  scales = panels[:, :, 512:].copy().view(np.float16)
  return q, scales


def test_int4_panels_hold_nibbles_by_groups_of_four_rows_then_float16_scales():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 96)).astype(np.float32)
  w[:32, 32:64] = 0  # an all-zero block: scale 0, weights 0
  panels = np.asarray(cpu_gemm.to_int4_panels(w))
  assert panels.shape == (3, 2, cpu_gemm.INT4_BLOCK) and panels.dtype == np.uint8 and cpu_gemm.INT4_BLOCK == 576
  q, scales = _unpack(panels)
  blocks = w.reshape(2, 32, 3, 32).transpose(2, 0, 1, 3)  # [T, B, k, c]
  want_scales = (np.max(np.abs(blocks), axis=2) / 7).astype(np.float16)
  np.testing.assert_array_equal(scales, want_scales)
  wide = want_scales.astype(np.float32)[:, :, None, :]
  want_q = np.where(wide > 0, np.clip(np.rint(blocks / np.where(wide > 0, wide, 1)), -7, 7), 0)
  np.testing.assert_array_equal(q, want_q)
  assert np.all(q[1, 0] == 0) and np.all(scales[1, 0] == 0)
  held = cpu_gemm.from_int4_panels(panels)
  np.testing.assert_array_equal(
      held, (q * scales[:, :, None, :].astype(np.float32)).transpose(1, 2, 0, 3).reshape(64, 96)
  )
  # Each weight within half a scale step of its own value.
  step = np.repeat(want_scales.astype(np.float32).transpose(1, 0, 2)[:, None], 32, axis=1).reshape(64, 96)
  assert np.all(np.abs(held - w) <= step / 2 * (1 + 1e-3) + 1e-8)


def test_int4_panels_dequantize_the_same_traced():
  panels = cpu_gemm.to_int4_panels(np.random.default_rng(1).standard_normal((64, 64)).astype(ml_dtypes.bfloat16))
  np.testing.assert_array_equal(np.asarray(jax.jit(cpu_gemm.from_int4_panels)(panels)), cpu_gemm.from_int4_panels(panels))
  abstract = cpu_gemm.to_int4_panels(jax.ShapeDtypeStruct((64, 96), jnp.bfloat16))
  assert abstract == jax.ShapeDtypeStruct((3, 2, cpu_gemm.INT4_BLOCK), jnp.uint8)


@needs_int4
@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (3, 640, 256), (8, 96, 64), (13, 64, 160)])
def test_int4_panels_match_float64_of_the_dequantized_weights(m, k, n):
  rng = np.random.default_rng(m * n)
  w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  panels = cpu_gemm.to_int4_panels(w)
  assert cpu_gemm.load()
  got = np.asarray(jax.jit(cpu_gemm.matmul)(jnp.asarray(x), panels))
  want = _rounded(x) @ cpu_gemm.from_int4_panels(panels).astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, float(np.max(np.abs(want)))))


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (cpu_gemm.to_int4_panels, (np.zeros((48, 32)),), r"int4 panels take .* got shape \(48, 32\)"),
        (cpu_gemm.from_int4_panels, (np.zeros((1, 1, 1152), np.uint8),), r"uint8 \[N / 32, K / 32, 576\], got uint8"),
        (cpu_gemm.matmul, (jnp.zeros((2, 32)), jnp.zeros((1, 1, 500), jnp.uint8)), r"1152 \(576\)\], got \(1, 1, 500\)"),
    ],
)
def test_int4_operands_are_checked(fn, args, match):
  with pytest.raises(ValueError, match=match):
    fn(*args)


def test_the_coarse_copy_serves_multiples_of_32_in_float32_compute_only():
  struct = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
  want = None if cpu_gemm.int8_dot_reason() else jax.ShapeDtypeStruct((16, 2, cpu_gemm.INT4_BLOCK), jnp.uint8)
  assert cpu_backend.to_int4_head(struct, jnp.float32) == want
  assert cpu_backend.to_int4_head(jax.ShapeDtypeStruct((64, 100), jnp.bfloat16), jnp.float32) is None
  assert cpu_backend.to_int4_head(struct, jnp.bfloat16) is None


def _embed(vocab: int = 512, features: int = 64, seed: int = 0) -> embeddings.Embed:
  return embeddings.Embed(vocab, features, weight_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def test_add_coarse_copy_checks_the_candidates_and_drops():
  embed = _embed()
  with pytest.raises(ValueError, match=r"nominates 1 to 512 \(the vocabulary\) candidates, got 0"):
    embed.add_coarse_copy(cpu_backend.PANELS_INT4, cpu_gemm.to_int4_panels, 0)
  with pytest.raises(ValueError, match="needs a coarse copy of the head"):
    embed.candidates(jnp.zeros((1, 64)))
  assert embed.add_coarse_copy(cpu_backend.PANELS_INT4, lambda flat, dtype: None, 8) == 0 and embed.coarse is None
  assert embed.add_coarse_copy(cpu_backend.PANELS_INT4, lambda flat, dtype: cpu_gemm.to_int4_panels(flat), 8) == (
      16 * 2 * cpu_gemm.INT4_BLOCK
  )
  assert embed.coarse_candidates == 8 and embed.coarse_layout == cpu_backend.PANELS_INT4
  embed.drop_coarse_copy()
  assert embed.coarse is None and embed.coarse_layout is None and embed.coarse_candidates == 0


@needs_int4
@pytest.mark.parametrize("rows", [1, 5])
def test_candidates_are_the_coarse_top_k_with_logits_from_the_table(rows):
  embed = _embed(seed=rows)
  backend = CpuBackend()
  assert backend.load_kernels()
  backend.configure(load_config(model_name="gemma3-tiny", weight_dtype="bfloat16", greedy_head_candidates=16))
  assert backend.prepare_params(embed) == 16 * 2 * cpu_gemm.INT4_BLOCK
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
  ids, logits, finite = jax.jit(functools.partial(embed.candidates, backend=backend))(x)
  assert ids.shape == logits.shape == (rows, 16) and ids.dtype == jnp.int32 and np.all(np.asarray(finite))
  table = np.asarray(embed.embedding[...]).astype(np.float64)  # [V, D]
  coarse = _rounded(np.asarray(x)) @ cpu_gemm.from_int4_panels(np.asarray(embed.coarse[...])).astype(np.float64)
  for r in range(rows):
    # The 16 best coarse scores, best first (no ties among random scores).
    np.testing.assert_array_equal(np.asarray(ids[r]), np.argsort(-coarse[r], kind="stable")[:16])
  want = np.einsum("rd,rkd->rk", np.asarray(x, np.float64), table[np.asarray(ids)])
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
  backend.restore_params(embed)
  assert embed.coarse is None


@needs_int4
def test_the_greedy_pick_through_the_candidates_is_the_whole_heads_and_flags_nan_rows():
  """gemma3-tiny (tied head, vocab 512): with every token a candidate the pick is exactly the whole head's; with 4,
  still the head's best token on random hidden states (the int4 ranking keeps it in the top 4); a NaN row is
  flagged."""
  llm = LLM(model_name="gemma3-tiny", weight_dtype="bfloat16", greedy_head_candidates=4, max_num_seqs=2)
  model = llm.engine.model
  assert model.model.embedder.coarse_candidates == 4
  hidden = jnp.asarray(np.random.default_rng(0).standard_normal((6, 96)), jnp.float32)
  ids, finite = jax.jit(model.greedy_token_ids)(hidden)
  whole = np.asarray(model.compute_logits(hidden))
  np.testing.assert_array_equal(np.asarray(ids), np.argmax(whole, axis=-1))
  assert np.all(np.asarray(finite))
  _, finite = jax.jit(model.greedy_token_ids)(hidden.at[2, 5].set(jnp.nan))
  np.testing.assert_array_equal(np.asarray(finite), [True, True, False, True, True, True])


@needs_int4
def test_greedy_decode_with_the_coarse_head_equals_the_whole_head():
  prompts = [[2, 17, 300, 45], [2, 9, 8, 7, 6, 5, 4, 3]]
  params = SamplingParams(max_tokens=8, temperature=0.0)
  whole = LLM(model_name="gemma3-tiny", weight_dtype="bfloat16").generate(prompts, params)
  coarse = LLM(model_name="gemma3-tiny", weight_dtype="bfloat16", greedy_head_candidates=512).generate(prompts, params)
  assert [o.outputs[0].token_ids for o in coarse] == [o.outputs[0].token_ids for o in whole]


def test_greedy_head_candidates_is_validated():
  with pytest.raises(ConfigError, match=r"greedy_head_candidates=-1: must be >= 0"):
    load_config(model_name="gemma3-tiny", greedy_head_candidates=-1)
  with pytest.raises(ConfigError, match=r"greedy_head_candidates=513: must be at most vocab_size \(512\)"):
    load_config(model_name="gemma3-tiny", greedy_head_candidates=513)
  cfg = load_config(model_name="gemma3-tiny", greedy_head_candidates=64)
  with pytest.raises(
      ConfigError, match=r"greedy_head_candidates=64 needs kernel_backend=cpu .* kernel_backend=reference reads"
  ):
    kernel_backend.get_backend("reference", None, cfg)
