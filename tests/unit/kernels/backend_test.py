"""The kernel backend seam: selection by config key, and every runner op of a model step going through it."""

import ast
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxtext
from maxtext.configs import ConfigError
from maxtext.inference import LLM, SamplingParams
from maxtext.kernels import backend as kb

CPU_PACKAGE = "maxtext.kernels.cpu."
# The modules that implement runner ops; only the backends may import them.
OP_MODULES = {
    "maxtext.kernels.ragged_paged_attention",
    "maxtext.kernels.ragged_conv1d",
    "maxtext.kernels.ragged_gated_delta_rule",
    "maxtext.kernels.ragged_mamba2",
    "maxtext.kernels.experts",
    "maxtext.kernels.moe",
}


def _imports(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)
    elif isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)


def _package_modules():
  root = pathlib.Path(maxtext.__file__).parent
  for path in sorted(root.rglob("*.py")):
    yield ".".join(path.relative_to(root.parent).with_suffix("").parts), path


def test_only_the_backends_import_the_op_modules():
  offenders = []
  for module, path in _package_modules():
    if module in OP_MODULES or module == "maxtext.kernels.backend" or module.startswith(CPU_PACKAGE):
      continue
    offenders += [f"{module} imports {name}" for name in set(_imports(path)) & OP_MODULES]
  assert not offenders


def test_only_the_cpu_backend_reaches_the_cpu_kernels():
  """The C++ kernels, their panels and huge pages are the `cpu` backend's: no other module imports them (the
  registry builds the backend by name)."""
  offenders = []
  for module, path in _package_modules():
    if not module.startswith(CPU_PACKAGE):
      offenders += [f"{module} imports {name}" for name in _imports(path) if name.startswith(CPU_PACKAGE)]
  assert not offenders
  assert kb.CPU_BACKEND_MODULE.startswith(CPU_PACKAGE)  # the registry builds it by this name
  assert isinstance(kb.get_backend(kb.CPU), importlib.import_module(kb.CPU_BACKEND_MODULE).CpuBackend)


class RecordingBackend(kb.ReferenceBackend):
  """The reference ops, recording each call's op name and its array arguments' shapes and dtypes."""

  name = "recording"
  calls: list = []

  # The overrides take the ops' arguments generically, record what they need and delegate.
  def ragged_paged_attention(self, q, k, v, kv_cache, *args, **kwargs):  # pylint: disable=arguments-differ
    RecordingBackend.calls.append(("attention", q.shape, None if k is None else k.shape, kv_cache.shape, kwargs))
    return super().ragged_paged_attention(q, k, v, kv_cache, *args, **kwargs)

  def gdn_attention(self, mixed_qkv, b, a, conv_state, recurrent_state, *args):  # pylint: disable=arguments-differ
    shapes = (mixed_qkv.shape, b.shape, a.shape, conv_state.shape, recurrent_state.shape, str(recurrent_state.dtype))
    # After the conv weight and bias, A_log, dt_bias and the four metadata arrays: the five static sizes.
    RecordingBackend.calls.append(("gdn", shapes, args[8:13]))
    return super().gdn_attention(mixed_qkv, b, a, conv_state, recurrent_state, *args)

  def moe_experts(self, x, weights, indices, *args, **kwargs):  # pylint: disable=arguments-differ
    RecordingBackend.calls.append(("moe", x.shape, indices.shape))
    return super().moe_experts(x, weights, indices, *args, **kwargs)


kb.register_backend("recording", RecordingBackend)


@pytest.mark.slow
def test_every_op_of_a_qwen3_next_step_goes_through_the_selected_backend():
  RecordingBackend.calls.clear()
  overrides = {"model_name": "qwen3-next-tiny", "max_num_batched_tokens": 32}
  recording = LLM(kernel_backend="recording", **overrides)
  assert isinstance(recording.engine.model.backend, RecordingBackend)
  prompts = [[5, 9, 33, 71, 12], [44, 3, 101]]
  got = recording.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
  reference = LLM(**overrides).generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
  assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]

  cfg = recording.cfg
  traces = recording.engine.stats.step_traces
  kinds = [c[0] for c in RecordingBackend.calls]
  # The ops run at trace time: every trace of the step calls each layer's op exactly once.
  assert kinds.count("gdn") == traces * cfg.layer_types.count("linear_attention")
  assert kinds.count("attention") == traces * cfg.layer_types.count("full_attention")
  assert kinds.count("moe") == traces * sum(cfg.moe_layers)
  gdn = next(c for c in RecordingBackend.calls if c[0] == "gdn")
  (qkv, b, a, conv, rec, rec_dtype), sizes = gdn[1], gdn[2]
  assert qkv[1] == cfg.gdn_conv_dim and b == a == (qkv[0], cfg.gdn_num_value_heads)
  assert conv[1:] == (cfg.gdn_conv_kernel_dim - 1, cfg.gdn_conv_dim) and rec_dtype == "float32"
  assert rec[1:] == (cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim)
  assert sizes == (
      cfg.gdn_num_key_heads,
      cfg.gdn_num_value_heads,
      cfg.gdn_key_head_dim,
      cfg.gdn_value_head_dim,
      cfg.gdn_conv_kernel_dim,
  )
  attention = next(c for c in RecordingBackend.calls if c[0] == "attention")
  assert attention[1][1:] == (cfg.base_num_query_heads, cfg.head_dim) and attention[4]["update_kv_cache"] is True


def test_get_backend_names_the_key_and_keeps_the_mesh():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  backend = kb.get_backend("reference", mesh)
  assert isinstance(backend, kb.ReferenceBackend) and backend.mesh is mesh
  with pytest.raises(ConfigError, match=r"kernel_backend='pallas': must be one of .*reference"):
    kb.get_backend("pallas")
  with pytest.raises(ValueError, match="'reference' is a built-in backend"):
    kb.register_backend("reference", kb.ReferenceBackend)
  with pytest.raises(ValueError, match="'cpu' is a built-in backend"):
    kb.register_backend("cpu", kb.ReferenceBackend)
  assert {"reference", "cpu"} <= set(kb.backend_names())
  assert kb.get_backend("", mesh).name == "reference"  # vLLM's default: never the C++ kernels unless asked
  with pytest.raises(ValueError, match="a kernel backend name must be a non-empty string"):
    kb.register_backend(" ", kb.ReferenceBackend)
  with pytest.raises(TypeError, match="abstract"):
    kb.KernelBackend()  # pylint: disable=abstract-class-instantiated  # the point of the test


def test_the_device_default_is_cpu_on_one_cpu_device_only():
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  assert kb.device_default_name(None) == kb.device_default_name(one) == "cpu"
  assert kb.device_default_name(two) == "reference"
  assert kb.get_backend("cpu", one).name == "cpu"
  with pytest.raises(ConfigError, match="kernel_backend=cpu runs on one CPU device .* the mesh has 2 devices"):
    kb.get_backend("cpu", two)


def test_the_reference_hooks_keep_the_parameters_and_xla_s_defaults():
  backend = kb.default_backend()
  assert not backend.compiler_options(1) and backend.place_params([jnp.zeros(4)]) is None
  assert backend.prepare_params(nnx.Module()) == 0


def test_reference_backend_rejects_what_it_does_not_implement():
  backend = kb.default_backend()
  q = jnp.zeros((1, 2, 16))
  cache = jnp.zeros((4, 4, 2, 1, 128))
  args = (q, q[:, :1], q[:, :1], cache, jnp.ones(1, jnp.int32), jnp.ones(4, jnp.int32), jnp.asarray([0, 1]))
  with pytest.raises(NotImplementedError, match="causal attention only"):
    backend.ragged_paged_attention(*args, jnp.asarray([0, 0, 1]), None, 1.0, use_causal_mask=False)
  with pytest.raises(NotImplementedError, match="no quantisation scales"):
    backend.ragged_paged_attention(*args, jnp.asarray([0, 0, 1]), None, 1.0, k_scale=0.5)
  x = jnp.zeros((2, 8))
  w = jnp.zeros((2, 8, 4))
  with pytest.raises(
      ValueError, match=r"MoE method must be one of \('tiled', 'ragged', 'dense', 'gather'\), got 'sorted'"
  ):
    backend.moe_experts(
        x,
        jnp.ones((2, 1)),
        jnp.zeros((2, 1), jnp.int32),
        w,
        w,
        w.transpose(0, 2, 1),
        activation=jax.nn.silu,
        dtype=jnp.float32,
        method="sorted",
    )
  with pytest.raises(ValueError, match=r"conv_weight \(6, 1, 3\) must be \[C, 1, kernel_size=4\]"):
    backend.gdn_attention(*([None] * 5), jnp.zeros((6, 1, 3)), *([None] * 7), 1, 1, 2, 2, 4)
