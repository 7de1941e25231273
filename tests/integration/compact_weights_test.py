"""Weight-only compact weights on the `cpu` kernel backend (bfloat16, `quantization=int8w`): greedy decoding agrees
with float32 compute over the same weights (tiny models) and with the float32 model (the README's example model, when
it is fetched)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import param_checks
from maxtext.configs import load_config
from maxtext.inference import LLM, SamplingParams
from maxtext.inference.engine import LLMEngine
from maxtext.kernels.cpu import cpu_gemm
from maxtext.kernels.cpu.backend import PANELS, PANELS_INT8
from maxtext.layers import linears

needs_kernel = pytest.mark.skipif(
    cpu_gemm.unsupported_reason() is not None, reason="the kernel needs x86-64 with AVX2 and FMA"
)

RUNNER = {"block_size": 4, "max_num_batched_tokens": 16, "min_token_bucket": 16, "max_num_seqs": 4, "seed": 0}
PROMPTS = ([5, 17, 300, 42, 7, 99], [11, 2, 480, 64])
CHAT_PROMPTS = ("What is the capital of France?", "Name a color.")


def _greedy(engine: LLMEngine, max_tokens: int) -> list[list[int]]:
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  ids = [engine.add_request(list(p), params) for p in PROMPTS]
  done = {}
  while engine.has_unfinished_requests():
    for finished in engine.step():
      done[finished.request_id] = finished.output_token_ids
  return [list(done[i]) for i in ids]


def _dense_layers(engine: LLMEngine) -> list[linears.DenseGeneral]:
  return [m for _, m in nnx.iter_modules(engine.model) if isinstance(m, linears.DenseGeneral)]


@needs_kernel
@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny"])
def test_bf16_weights_decode_as_float32_compute_over_the_same_weights(name):
  """The `cpu` backend reading bfloat16 panels and a bfloat16 tied table (qwen3-tiny) or head (llama-tiny) greedily
  decodes the tokens the reference backend decodes from the same bfloat16 weights cast to float32 (XLA's dots)."""
  engines = {
      backend: LLMEngine(
          load_config(model_name=name, weight_dtype="bfloat16", kernel_backend=backend, max_target_length=48, **RUNNER)
      )
      for backend in ("cpu", "reference")
  }
  layers = _dense_layers(engines["cpu"])
  assert layers and all(l.kernel[...].dtype == jnp.bfloat16 for l in layers)
  assert sum(l.layout == PANELS for l in layers) >= len(layers) - 1  # all but a head of N not a multiple of 32
  tokens = {backend: _greedy(engine, 12) for backend, engine in engines.items()}
  assert tokens["cpu"] == tokens["reference"] and all(len(t) == 12 for t in tokens["cpu"])


@pytest.fixture(name="chat_tokens", scope="module")
def fixture_chat_tokens(example_gguf):
  """Greedy tokens of the README's chat prompts per weight mode, 32 new tokens each."""

  def run(**overrides):
    llm = LLM(
        gguf_model_path=example_gguf,
        model_name="smollm2-135m-instruct",
        use_chat_template=True,
        max_target_length=256,
        **overrides,
    )
    outputs = llm.generate(list(CHAT_PROMPTS), SamplingParams(max_tokens=32, temperature=0.0))
    return llm, [list(o.outputs[0].token_ids) for o in outputs]

  return run


@pytest.mark.slow
@needs_kernel
def test_example_model_in_bf16_decodes_the_float32_tokens(chat_tokens):
  llm, bf16 = chat_tokens(weight_dtype="bfloat16")
  layers = _dense_layers(llm.engine)
  assert all(l.layout == PANELS and l.kernel[...].dtype == jnp.bfloat16 for l in layers)
  embedding = [m for _, m in nnx.iter_modules(llm.engine.model) if type(m).__name__ == "Embed"]
  assert embedding and all(e.embedding[...].dtype == jnp.bfloat16 for e in embedding)
  del llm
  _, float32 = chat_tokens()
  assert bf16 == float32


def _dense_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
  """Greedy tokens of the full-sequence forward, the whole sequence again per token (XLA's dots throughout)."""
  ids = list(prompt)
  for _ in range(max_tokens):
    ids.append(int(np.argmax(np.asarray(model(np.asarray([ids], np.int32))[0, -1]))))
  return ids[len(prompt) :]


@needs_kernel
@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny"])
def test_int8w_decodes_as_xla_over_the_dequantized_weights(name):
  """`quantization=int8w`: the dense kernels are int8 panels; the engine's greedy tokens are those of the
  full-sequence model over the same weights dequantized (`restore_params`), computed by XLA."""
  engine = LLMEngine(
      load_config(model_name=name, weight_dtype="bfloat16", quantization="int8w", max_target_length=48, **RUNNER)
  )
  layers = _dense_layers(engine)
  assert sum(l.layout == PANELS_INT8 for l in layers) >= len(layers) - 1
  assert all(l.kernel[...].dtype == jnp.uint8 for l in layers if l.layout == PANELS_INT8)
  tokens = _greedy(engine, 12)
  dense = param_checks.canonical_model(engine)
  assert tokens == [_dense_greedy(dense, p, 12) for p in PROMPTS]


@pytest.mark.slow
@needs_kernel
def test_example_model_in_int8w_decodes_the_float32_tokens(chat_tokens):
  llm, int8w = chat_tokens(weight_dtype="bfloat16", quantization="int8w")
  assert all(l.layout == PANELS_INT8 for l in _dense_layers(llm.engine))
  del llm
  _, float32 = chat_tokens()
  assert int8w == float32
