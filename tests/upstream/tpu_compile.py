"""MaxTextForCausalLM's runner step compiled ahead of time for TPU slices, on a machine without a TPU.

libtpu describes a TPU slice without its chips (`jax.experimental.topologies.get_topology_desc`), and JAX compiles a
program for it: `jax.jit(f).trace(*abstract inputs).lower().compile()` under the slice's mesh gives the TPU
executable's HLO, `memory_analysis()` (argument, output, temporary bytes per chip) and `cost_analysis()` (flops,
bytes accessed, XLA's time estimate; a Pallas kernel is an opaque custom call to it). Nothing is allocated: the
weights, caches and metadata are `jax.ShapeDtypeStruct`s with the runner's shardings, so real sizes compile too.

The step is built as tpu-inference 0.32.0's runner builds it, from its own parts where they can be called:
- the model: `cls(vllm_config, rng, mesh)` under `nnx.eval_shape` (`models/common/model_loader.py::_get_nnx_model`),
  with `kernel_backend=tpu_inference`, so attention and Gated DeltaNet call tpu-inference's real
  `sharded_ragged_paged_attention` (its Pallas RPA v3 kernel) and `run_jax_gdn_attention`;
- the jitted step: `runner_step` replicates `get_flax_model`'s wrapper (`run_model_impl`: state leaves unflattened
  and merged; `jax.jit` with `donate_argnums=1`, `static_argnums=(6, 9, 10)`, the caches' own shardings and
  `P(ATTN_DATA, None)` for the hidden states as outputs) and compiles it with tpu-inference's own step compiler
  options (`get_step_fn_compiler_options`, the `xla_tpu_*` flags a TPU run uses);
- the caches: the physical list in the runner's order (this package's replica of vLLM's grouping and tpu-inference's
  slot keys, checked against both in the tier's other tests), attention shapes checked against tpu-inference's
  `runner/kv_cache.py::get_kv_cache_shape_with_mesh`, shardings as `runner/kv_cache.py::create_kv_caches` and
  `runner/kv_cache_manager.py` (mamba states) give them;
- the metadata: tpu-inference's own `AttentionMetadata` and `GroupedAttentionMetadata`, in the shapes its runner
  pads to (`padded_num_reqs = max_num_seqs`, block tables `max_num_seqs x cdiv(max_model_len, block_size)`).

Two stand-ins (`install`), for the two tpu-inference functions that ask `jax.devices()[0].device_kind` which chip
they run on: the host's CPU here, where on a TPU VM it is the chip being compiled for. `kernels/ragged_paged_attention/
v3/util.py::get_tpu_version` (the RPA kernel's block sizes and bf16 path) and `utils.py::get_device_name` (the tuned
block-size tables' key, e.g. for head_dim 64) answer for the target chip instead. `pltpu.get_tpu_info()` already
follows the compile target.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

# libtpu resolves the slice's hosts by name; without this it logs a hostname error for every topology.
# No chip is opened, so the lock libtpu takes against a second process using the same TPU guards nothing here.
TOPOLOGY_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's published figures (per chip), for the fit and roofline tables."""

  name: str
  device_kind: str
  version: int
  hbm_bytes: int
  bf16_flops: float  # peak dense bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s


CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", 5, 16 << 30, 197e12, 819e9),
    "v6e": Chip("v6e", "TPU v6 lite", 6, 32 << 30, 918e12, 1640e9),
}
# Slices of 4 and 8 chips (libtpu 0.0.48 refuses a single-chip topology on this host shape).
SLICES = {4: "2x2", 8: "2x4"}


@dataclasses.dataclass(frozen=True)
class StepShape:
  """A step as the runner buckets it: `num_tokens` padded tokens over `max_num_seqs` request rows."""

  name: str
  num_tokens: int


def topology_name(chip: str, num_chips: int) -> str:
  """libtpu's topology name of a slice, e.g. `v6e:2x2`."""
  if chip not in CHIPS or num_chips not in SLICES:
    raise ValueError(f"no slice of {num_chips} {chip} chips here (chips: {sorted(CHIPS)}, sizes: {sorted(SLICES)})")
  return f"{chip}:{SLICES[num_chips]}"


_TARGET: list[Chip] = []  # the chip being compiled for, read by the stand-ins


def _target() -> Chip:
  if not _TARGET:
    raise RuntimeError("no TPU target set: compile through tpu_compile.compile_step")
  return _TARGET[-1]


def target_tpu_version() -> int:
  """Stands in for `tpu_inference/kernels/ragged_paged_attention/v3/util.py::get_tpu_version` (reads the host's
  first device, the CPU here): the version of the chip being compiled for."""
  return _target().version


def target_device_name(num_devices: int | None = None) -> str:
  """Stands in for `tpu_inference/utils.py::get_device_name` (the host's first device, the CPU here, raises
  "Expected TPU devices"): the name it gives the chip being compiled for, e.g. `TPU v6e` (`-N` with a count)."""
  name = f"TPU {_target().name}"
  return name if num_devices is None else f"{name}-{num_devices}"


def _rebind(original: Any, replacement: Any) -> None:
  for name, module in list(sys.modules.items()):
    if module is not None and name.startswith("tpu_inference"):
      for attr, value in list(vars(module).items()):
        if value is original:
          setattr(module, attr, replacement)


def install() -> None:
  """Sets libtpu's environment and puts the two stand-ins in place wherever the originals are bound."""
  os.environ.update(TOPOLOGY_ENV)
  # pylint: disable=import-outside-toplevel  # after the environment is set
  import tpu_inference.utils as tpu_utils
  from tpu_inference.kernels.ragged_paged_attention.v3 import tuned_block_sizes, tuned_block_sizes_hd64, util

  del tuned_block_sizes, tuned_block_sizes_hd64  # imported so that their bindings are rebound too
  if util.get_tpu_version is not target_tpu_version:
    _rebind(util.get_tpu_version, target_tpu_version)
  if tpu_utils.get_device_name is not target_device_name:
    _rebind(tpu_utils.get_device_name, target_device_name)


def slice_mesh(chip: str, num_chips: int, tp: int):
  """The runner's 2-D `('data', 'model')` mesh over the first `tp` chips of a `num_chips` slice."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology_name(chip, num_chips)).devices
  if tp > len(devices):
    raise ValueError(f"tp={tp} needs {tp} chips; the {chip} slice has {len(devices)}")
  return jax.sharding.Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))


@dataclasses.dataclass
class CompiledStep:
  """What one compile gave: per-chip memory, XLA's cost estimate, the optimised HLO and how long it took."""

  model: str
  chip: str
  tp: int
  step: str
  num_tokens: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  flops: float
  bytes_accessed: float
  optimal_seconds: float
  hlo_text: str
  unoptimized_hlo_text: str  # the program as handed to XLA, before its passes
  num_cache_leaves: int
  custom_calls: dict[str, int]
  compile_seconds: float
  param_bytes: int  # per chip
  cache_bytes: int  # per chip

  @property
  def peak_bytes(self) -> int:
    """HBM one chip needs for the step: its arguments (weights, caches, inputs), outputs not aliased onto a donated
    argument, temporaries and code."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.generated_code_bytes

  def instruction_count(self) -> int:
    """HLO instructions of the optimised module (every computation)."""
    return hlo_instruction_count(self.hlo_text)

  def aliased_inputs(self) -> int:
    """Inputs whose buffers the outputs reuse (`input_output_alias` of the compiled module)."""
    header = self.hlo_text.split("\n", 1)[0]
    return len(re.findall(r"\{[\d,\s]*\}: \(\d+, \{[\d,\s]*\}, (?:may|must)-alias\)", header))

  def all_gather_sources(self) -> list[str]:
    """The JAX operation (`op_name` metadata) each all-gather of the optimised module comes from."""
    sources = []
    for line in self.hlo_text.splitlines():
      if re.search(r"\sall-gather(?:-start)?\(", line):
        match = re.search(r'op_name="([^"]+)"', line)
        sources.append(match.group(1) if match else "")
    return sources

  def collectives(self) -> dict[str, int]:
    """Collective and copy instructions of the optimised module, by opcode."""
    return hlo_opcodes(self.hlo_text, COLLECTIVE_OPCODES)


COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "all-reduce-start",
    "all-gather-start",
    "collective-permute-start",
    "copy",
    "copy-start",
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?[%\w.\-]+\s*=\s*\S.*?\s([a-z][\w\-]*)\(", re.MULTILINE)


def hlo_opcodes(hlo_text: str, opcodes: Sequence[str] | None = None) -> dict[str, int]:
  """Instruction count per opcode of an HLO module's text (only `opcodes` when given)."""
  counts: dict[str, int] = {}
  for match in _INSTRUCTION.finditer(hlo_text):
    op = match.group(1)
    if opcodes is None or op in opcodes:
      counts[op] = counts.get(op, 0) + 1
  return counts


def hlo_instruction_count(hlo_text: str) -> int:
  """Instructions of an HLO module's text, every computation included."""
  return sum(hlo_opcodes(hlo_text).values())


def _custom_call_targets(hlo_text: str) -> dict[str, int]:
  counts: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
    counts[target] = counts.get(target, 0) + 1
  return counts


def _sharded_bytes(leaves: Sequence[Any]) -> int:
  total = 0
  for leaf in leaves:
    shape = leaf.sharding.shard_shape(tuple(leaf.shape)) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def model_overrides(model_name: str, tp: int, max_model_len: int, max_num_seqs: int) -> dict[str, Any]:
  """The `maxtext_config` of a TPU run: tpu-inference's kernels, bfloat16, the runner's tensor parallelism."""
  return {
      "model_name": model_name,
      "kernel_backend": "tpu_inference",
      "ici_tensor_parallelism": tp,
      "max_target_length": max_model_len,
      "max_num_seqs": max_num_seqs,
  }


def _vllm_config(overrides: Mapping[str, Any], block_size: int):
  # pylint: disable=import-outside-toplevel
  from support.fake_vllm_config import fake_vllm_config

  model_keys = {k: v for k, v in overrides.items() if k not in ("max_num_seqs", "max_target_length")}
  return fake_vllm_config(model_keys, load_format="dummy", block_size=block_size, dtype="bfloat16")


def abstract_model(overrides: Mapping[str, Any], mesh, block_size: int):
  """`MaxTextForCausalLM(vllm_config, rng, mesh)` under `nnx.eval_shape`, every parameter a `ShapeDtypeStruct` in
  the sharding the model creates it in (`maxtext.models.sharding.param_shardings`)."""
  # pylint: disable=import-outside-toplevel
  import jax
  from flax import nnx

  from maxtext.integration.vllm.adapter import MaxTextForCausalLM
  from maxtext.models import sharding

  vllm_config = _vllm_config(overrides, block_size)
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: MaxTextForCausalLM(vllm_config, jax.random.key(0), mesh))
  shardings = sharding.param_shardings(model.cfg, mesh)
  for path, var in nnx.to_flat_state(nnx.state(model.model, nnx.Param)):
    leaf = var.get_value()
    var.set_value(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings[".".join(map(str, path))]))
  return model


def runner_cache_sharding(mesh, cache: Any, index: int):
  """The sharding the runner allocates a cache array with: attention `P(BATCH, KV_CONTEXT, KV_HEAD)`
  (`runner/kv_cache.py::create_kv_caches`); mamba conv `P(ATTN_DATA, None, ATTN_HEAD)`, ssm `P(ATTN_DATA, ATTN_HEAD,
  None, None)` (`runner/kv_cache_manager.py`, pass 2)."""
  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec
  from tpu_inference.layers.common.sharding import ShardingAxisName as Axis

  if index < 0:
    return NamedSharding(mesh, PartitionSpec(Axis.BATCH, Axis.KV_CONTEXT, Axis.KV_HEAD))
  if index == 0:
    return NamedSharding(mesh, PartitionSpec(Axis.ATTN_DATA, None, Axis.ATTN_HEAD))
  return NamedSharding(mesh, PartitionSpec(Axis.ATTN_DATA, Axis.ATTN_HEAD, *([None] * (len(cache.shape) - 2))))


def abstract_caches(overrides: Mapping[str, Any], mesh, block_size: int, num_blocks: int, layout: str = "hybrid"):
  """The physical cache list (abstract, in the runner's shardings), the static map and the KV-cache manager.

  Raises:
    AssertionError: an attention array's shape differs from tpu-inference's `get_kv_cache_shape_with_mesh`.
  """
  # pylint: disable=import-outside-toplevel
  import jax
  from tpu_inference.runner.kv_cache import get_kv_cache_shape_with_mesh

  from maxtext.checkpoint.model_loader import load_run_config
  from maxtext.inference.engine_build import make_kv_cache_manager

  cfg = load_run_config(
      **overrides,
      dtype="bfloat16",
      weight_dtype="bfloat16",
      block_size=block_size,
      num_kv_blocks=num_blocks,
      kv_cache_layout=layout,
      hybrid_kv_cache=True,
  )
  manager = make_kv_cache_manager(cfg)
  caches = []
  for slot, entry in zip(manager.describe_slots(num_blocks), manager.cache_shapes(num_blocks)):
    if isinstance(entry, tuple):
      caches.append(
          tuple(
              jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=runner_cache_sharding(mesh, s, i))
              for i, s in enumerate(entry)
          )
      )
      continue
    # The runner pads the KV heads to the tensor-parallel size (as the spec has them) before asking for the shape.
    upstream = get_kv_cache_shape_with_mesh(
        mesh, num_blocks, slot.spec.block_size, slot.spec.num_kv_heads, slot.spec.head_dim, entry.dtype
    )
    assert tuple(upstream) == tuple(entry.shape), f"kv_caches[{slot.slot}] {entry.shape}, tpu-inference's {upstream}"
    caches.append(jax.ShapeDtypeStruct(entry.shape, entry.dtype, sharding=runner_cache_sharding(mesh, entry, -1)))
  return caches, manager.layer_name_to_kvcache_index, manager


def abstract_metadata(manager, mesh, step: StepShape, max_num_seqs: int, max_model_len: int):
  """tpu-inference's metadata of a step: one `AttentionMetadata`, or a `GroupedAttentionMetadata` per group."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec
  from tpu_inference.layers.common.attention_metadata import AttentionMetadata, GroupedAttentionMetadata

  replicated = NamedSharding(mesh, PartitionSpec())

  def arr(*shape: int):
    return jax.ShapeDtypeStruct(shape, np.int32, sharding=replicated)

  groups = []
  for group in manager.groups:
    pages = math.ceil(max_model_len / (group.block_size or manager.mamba_block_size or 1))
    groups.append(
        AttentionMetadata(
            input_positions=arr(step.num_tokens),
            block_tables=arr(max_num_seqs * pages),
            seq_lens=arr(max_num_seqs),
            query_start_loc=arr(max_num_seqs + 1),
            request_distribution=arr(3),
            mamba_state_indices=arr(max_num_seqs) if manager.has_recurrent else None,
            padded_num_reqs=max_num_seqs,
        )
    )
  if len(groups) == 1:
    return groups[0]
  return GroupedAttentionMetadata(groups, [group.layer_names for group in manager.groups])


def runner_step(model, mesh, kv_cache_shardings):
  """The step function as tpu-inference's `get_flax_model` jits it (`models/common/model_loader.py`), with the
  model's state as flat leaves, and the leaves."""
  # pylint: disable=import-outside-toplevel
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec
  from tpu_inference.layers.common.sharding import ShardingAxisName

  graphdef, state = nnx.split(model)
  treedef = jax.tree_util.tree_structure(state)

  def run_model_impl(state_leaves, *args):
    merged = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, state_leaves))
    return merged(*args)

  hidden = NamedSharding(mesh, PartitionSpec(ShardingAxisName.ATTN_DATA, None))
  step = jax.jit(
      run_model_impl,
      out_shardings=(kv_cache_shardings, hidden, hidden, None),
      donate_argnums=1,
      static_argnums=(6, 9, 10),
  )
  return step, tuple(jax.tree_util.tree_leaves(state))


def compile_step(
    model_name: str,
    chip: str,
    tp: int,
    step: StepShape,
    *,
    num_chips: int = 4,
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    block_size: int = 16,
    num_blocks: int = 256,
    layout: str = "hybrid",
    extra: Mapping[str, Any] | None = None,
) -> CompiledStep:
  """Compiles one runner step of `model_name` for `tp` chips of a `chip` slice and reports what XLA says of it.

  `layout` orders the physical caches (`kv_cache_layout`: `hybrid` is tpu-inference's order; `layer` and `shuffled`
  give the same arrays in other orders, for the remap's cost); `extra` adds config keys.
  """
  install()
  _TARGET.append(CHIPS[chip])
  try:
    mesh = slice_mesh(chip, num_chips, tp)
    overrides = {**model_overrides(model_name, tp, max_model_len, max_num_seqs), **(extra or {})}
    model = abstract_model(overrides, mesh, block_size)
    caches, mapping, manager = abstract_caches(overrides, mesh, block_size, num_blocks, layout)
    metadata = abstract_metadata(manager, mesh, step, max_num_seqs, max_model_len)
    return _compile(model_name, chip, tp, step, model, mesh, caches, metadata, mapping)
  finally:
    _TARGET.pop()


def _compile(name, chip, tp, step, model, mesh, caches, metadata, mapping) -> CompiledStep:  # pylint: disable=R0917
  """Traces `model`'s runner step over the abstract inputs, compiles it for the mesh's TPUs and reads the result."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec
  from tpu_inference.models.common.compiler_options import get_step_fn_compiler_options

  replicated = NamedSharding(mesh, PartitionSpec())
  input_ids = jax.ShapeDtypeStruct((step.num_tokens,), np.int32, sharding=replicated)
  positions = jax.ShapeDtypeStruct((step.num_tokens,), np.int32, sharding=replicated)
  cache_shardings = jax.tree_util.tree_map(lambda c: c.sharding, caches)
  fn, leaves = runner_step(model, mesh, cache_shardings)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = fn.trace(leaves, caches, input_ids, metadata, None, positions, mapping, None, None, True, True).lower()
    compiled = lowered.compile(compiler_options=get_step_fn_compiler_options())
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  return CompiledStep(
      model=name,
      chip=chip,
      tp=tp,
      step=step.name,
      num_tokens=step.num_tokens,
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes),
      generated_code_bytes=int(memory.generated_code_size_in_bytes),
      flops=float(cost.get("flops", 0.0)),
      bytes_accessed=float(cost.get("bytes accessed", 0.0)),
      optimal_seconds=float(cost.get("optimal_seconds", 0.0)),
      hlo_text=hlo,
      unoptimized_hlo_text=lowered.as_text(dialect="hlo"),
      num_cache_leaves=len(jax.tree_util.tree_leaves(caches)),
      custom_calls=_custom_call_targets(hlo),
      compile_seconds=seconds,
      param_bytes=_sharded_bytes(leaves),
      cache_bytes=_sharded_bytes(jax.tree_util.tree_leaves(caches)),
  )


# tpu-inference's own JAX models of the families it also implements: `models/jax/<module>.py::<class>`.
UPSTREAM_MODELS = {"llama": ("llama3", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}


def upstream_vllm_config(hf_config: Any, folder: str, max_model_len: int, block_size: int):
  """A real `VllmConfig` for an HF config (written to `folder` as config.json; no weights, no tokenizer)."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from vllm.config import CacheConfig, ModelConfig, VllmConfig

  hf_config.save_pretrained(folder)
  model_config = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len)
  vllm_config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=block_size))
  vllm_config.model_config.dtype = jnp.bfloat16  # as get_flax_model sets it before building the model
  return vllm_config


def compile_upstream_step(
    family: str,
    hf_config: Any,
    folder: str,
    chip: str,
    tp: int,
    step: StepShape,
    *,
    num_chips: int = 4,
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    block_size: int = 16,
    num_blocks: int = 256,
) -> CompiledStep:
  """tpu-inference's own JAX model of `family` ("llama" or "qwen3") for `hf_config`, compiled as `compile_step`
  compiles this package's: the same jit wrapper, compiler options, metadata and cache shapes (one array per layer,
  `get_kv_cache_shape_with_mesh` of the heads padded to the TP size, `create_kv_caches`' sharding)."""
  # pylint: disable=import-outside-toplevel
  import importlib

  import jax
  from flax import nnx
  from jax.sharding import NamedSharding
  from tpu_inference.distributed.jax_parallel_state import init_pp_distributed_environment
  from tpu_inference.layers.common.attention_metadata import AttentionMetadata
  from tpu_inference.runner.kv_cache import get_kv_cache_shape_with_mesh
  from tpu_inference.utils import get_padded_num_heads

  install()
  _TARGET.append(CHIPS[chip])
  try:
    module, cls_name = UPSTREAM_MODELS[family]
    cls = getattr(importlib.import_module(f"tpu_inference.models.jax.{module}"), cls_name)
    init_pp_distributed_environment("127.0.0.1", 0, 1, None, need_pp=False)  # one pipeline stage
    vllm_config = upstream_vllm_config(hf_config, folder, max_model_len, block_size)
    mesh = slice_mesh(chip, num_chips, tp)
    with jax.set_mesh(mesh):
      model = nnx.eval_shape(lambda: cls(vllm_config, jax.random.key(0), mesh))
    # The abstract state carries its shardings on an abstract mesh; the step takes them on the slice's devices.
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      leaf = var.get_value()
      var.set_value(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, leaf.sharding.spec)))
    heads = get_padded_num_heads(hf_config.num_key_value_heads, tp)
    shape = get_kv_cache_shape_with_mesh(mesh, num_blocks, block_size, heads, hf_config.head_dim, jax.numpy.bfloat16)
    cache = jax.ShapeDtypeStruct(shape, jax.numpy.bfloat16, sharding=runner_cache_sharding(mesh, None, -1))
    layers = hf_config.num_hidden_layers
    caches = [cache] * layers
    mapping = tuple((f"layer.{i}", i) for i in range(layers))
    metadata = abstract_metadata(_OneGroup(block_size), mesh, step, max_num_seqs, max_model_len)
    assert isinstance(metadata, AttentionMetadata)
    return _compile(f"tpu-inference {cls_name}", chip, tp, step, model, mesh, caches, metadata, mapping)
  finally:
    _TARGET.pop()


@dataclasses.dataclass
class _OneGroup:
  """The KV-cache manager facts `abstract_metadata` reads, for a model with one attention group."""

  block_size: int
  has_recurrent: bool = False
  mamba_block_size: int = 0

  @property
  def groups(self):
    """The one group: this object."""
    return [self]
