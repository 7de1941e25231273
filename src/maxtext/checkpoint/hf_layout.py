"""Which Hugging Face tensors make which canonical parameters, and how they are re-laid-out.

Each `Recipe` reads one or more on-disk tensors (checked against their expected shapes before anything is loaded) and
produces one or more canonical parameters (docs/architecture.md names, kernels [in, out...]). Layouts handled here:
  - q/k/v_proj [H*Dh, D] -> [D, H, Dh]; o_proj [D, Hq*Dh] -> [Hq, Dh, D]; Linear [out, in] -> [in, out].
  - Qwen3-Next / Qwen3.5 gated q_proj [Hq*2*Dh, D], rows per head [q_h | gate_h] -> q and gate [D, Hq, Dh].
  - Qwen3-Next grouped in_proj_qkvz (rows per key head g: [q_g hk | k_g hk | v_g r*hv | z_g r*hv]) and in_proj_ba
    (rows per g: [b_g r | a_g r]) -> the flat Qwen3.5 layout qkv [q nk*hk | k nk*hk | v nv*hv], z, b, a.
  - conv1d.weight [C, 1, K] -> [K, C].
  - Mamba2 in_proj [I + C + nh, D], rows [z I | xBC C | dt nh] -> z [D, I], xbc [D, C], dt [D, nh] (and its bias).
  - Granite 4.0 fused MLPs: shared_mlp.input_linear [2 Fs, D] (gate rows first) -> gate, up [D, Fs];
    block_sparse_moe experts (transformers 5 `experts.gate_up_proj` / `experts.down_proj`, or the original
    `input_linear` / `output_linear`) as the fused MoE layout; the router as `router.weight` or `router.layer.weight`.
  - MoE experts, per-expert keys (`experts.{e}.gate_proj.weight`, as save_pretrained and the Hub write them) or the
    fused transformers 5 layout (`experts.gate_up_proj` [E, 2*Fe, D], `experts.down_proj` [E, D, Fe]) -> stacked
    [E, D, Fe] / [E, Fe, D], filled expert by expert into one preallocated array.
  - gpt-oss experts: `experts.gate_up_proj` [E, D, 2*Fe] with gate and up INTERLEAVED along the last axis (gate at
    even columns, up at odd ones; the same for `gate_up_proj_bias` [E, 2*Fe]) -> gate, up [E, D, Fe];
    `experts.down_proj` [E, Fe, D] is already [in, out]; `router.weight` [E, D] / `router.bias` [E]; `self_attn.sinks`.
"""

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from maxtext.configs import families
from maxtext.configs.families.family import FFN_FEED_FORWARD, FFN_GRANITE, FFN_MLP, GDN_GROUPED
from maxtext.configs.layer_kinds import FULL_ATTENTION, LINEAR_ATTENTION, MAMBA, SLIDING_ATTENTION

Shape = tuple[int, ...]
# read(j) loads the j-th source tensor of a recipe in its stored dtype.
Reader = Callable[[int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How to build canonical parameters from on-disk tensors.

  Attributes:
    sources: normalised Hugging Face names, read in this order.
    source_shapes: the on-disk shape each source must have.
    targets: (canonical name, shape) of every output.
    convert: (read, dtype) -> one array per target, in `targets` order, of dtype `dtype`.
  """

  sources: tuple[str, ...]
  source_shapes: tuple[Shape, ...]
  targets: tuple[tuple[str, Shape], ...]
  convert: Callable[[Reader, Any], tuple[np.ndarray, ...]]


def _cast(x: np.ndarray, dtype: Any) -> np.ndarray:
  return np.ascontiguousarray(x.astype(dtype, copy=False))


def _same(source: str, shape: Shape, target: str) -> Recipe:
  return Recipe((source,), (shape,), ((target, shape),), lambda read, dt: (_cast(read(0), dt),))


def _linear(source: str, out_dim: int, in_dim: int, target: str) -> Recipe:
  """Linear weight [out, in] -> kernel [in, out]."""
  return Recipe((source,), ((out_dim, in_dim),), ((target, (in_dim, out_dim)),), lambda read, dt: (_cast(read(0).T, dt),))


def _heads_in(source: str, heads: int, head_dim: int, hidden: int, target: str) -> Recipe:
  """q/k/v_proj [H*Dh, D] -> [D, H, Dh]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    return (_cast(read(0).T.reshape(hidden, heads, head_dim), dt),)

  return Recipe((source,), ((heads * head_dim, hidden),), ((target, (hidden, heads, head_dim)),), convert)


def _head_bias(source: str, heads: int, head_dim: int, target: str) -> Recipe:
  """q/k/v_proj.bias [H*Dh] -> [H, Dh]."""
  return Recipe(
      (source,),
      ((heads * head_dim,),),
      ((target, (heads, head_dim)),),
      lambda read, dt: (_cast(read(0).reshape(heads, head_dim), dt),),
  )


def _gated_q(source: str, heads: int, head_dim: int, hidden: int, q_target: str, gate_target: str) -> Recipe:
  """Gated q_proj [Hq*2*Dh, D], rows per head [q_h | gate_h] -> q, gate [D, Hq, Dh]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(heads, 2, head_dim, hidden)
    return _cast(w[:, 0].transpose(2, 0, 1), dt), _cast(w[:, 1].transpose(2, 0, 1), dt)

  shape = (hidden, heads, head_dim)
  return Recipe((source,), ((heads * 2 * head_dim, hidden),), ((q_target, shape), (gate_target, shape)), convert)


def _o_proj(source: str, heads: int, head_dim: int, hidden: int, target: str) -> Recipe:
  """o_proj [D, Hq*Dh] -> [Hq, Dh, D]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    return (_cast(read(0).T.reshape(heads, head_dim, hidden), dt),)

  return Recipe((source,), ((hidden, heads * head_dim),), ((target, (heads, head_dim, hidden)),), convert)


def _grouped_qkvz(source: str, nk: int, nv: int, hk: int, hv: int, hidden: int, qkv: str, z: str) -> Recipe:
  """Qwen3-Next in_proj_qkvz, grouped per key head, -> flat qkv [D, C] and z [D, nv*hv]."""
  r = nv // nk

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(nk, 2 * hk + 2 * r * hv, hidden)
    q, k, v, zz = w[:, :hk], w[:, hk : 2 * hk], w[:, 2 * hk : 2 * hk + r * hv], w[:, 2 * hk + r * hv :]
    flat = np.concatenate([q.reshape(nk * hk, hidden), k.reshape(nk * hk, hidden), v.reshape(nv * hv, hidden)])
    return _cast(flat.T, dt), _cast(zz.reshape(nv * hv, hidden).T, dt)

  conv_dim = 2 * nk * hk + nv * hv
  return Recipe(
      (source,),
      ((2 * nk * hk + 2 * nv * hv, hidden),),
      ((qkv, (hidden, conv_dim)), (z, (hidden, nv * hv))),
      convert,
  )


def _grouped_ba(source: str, nk: int, nv: int, hidden: int, b: str, a: str) -> Recipe:
  """Qwen3-Next in_proj_ba, rows per key head [b_g r | a_g r], -> b, a [D, nv]."""
  r = nv // nk

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(nk, 2 * r, hidden)
    return _cast(w[:, :r].reshape(nv, hidden).T, dt), _cast(w[:, r:].reshape(nv, hidden).T, dt)

  return Recipe((source,), ((2 * nv, hidden),), ((b, (hidden, nv)), (a, (hidden, nv))), convert)


def _conv(source: str, channels: int, kernel: int, target: str) -> Recipe:
  """Depthwise conv1d.weight [C, 1, K] -> [K, C]."""
  return Recipe(
      (source,),
      ((channels, 1, kernel),),
      ((target, (kernel, channels)),),
      lambda read, dt: (_cast(read(0)[:, 0, :].T, dt),),
  )


def _stacked(sources: Sequence[str], out_dim: int, in_dim: int, target: str) -> Recipe:
  """Per-expert Linear weights [out, in] -> one [E, in, out] array, filled expert by expert."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    out = np.empty((len(sources), in_dim, out_dim), dtype=dt)
    for e in range(len(sources)):
      out[e] = read(e).T.astype(dt, copy=False)
    return (out,)

  shapes = tuple((out_dim, in_dim) for _ in sources)
  return Recipe(tuple(sources), shapes, ((target, (len(sources), in_dim, out_dim)),), convert)


def _fused_gate_up(source: str, experts: int, moe_dim: int, hidden: int, gate: str, up: str) -> Recipe:
  """transformers 5 experts.gate_up_proj [E, 2*Fe, D] (gate rows first) -> gate, up [E, D, Fe]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    return _cast(w[:, :moe_dim].transpose(0, 2, 1), dt), _cast(w[:, moe_dim:].transpose(0, 2, 1), dt)

  shape = (experts, hidden, moe_dim)
  return Recipe((source,), ((experts, 2 * moe_dim, hidden),), ((gate, shape), (up, shape)), convert)


def _fused_down(source: str, experts: int, moe_dim: int, hidden: int, target: str) -> Recipe:
  """transformers 5 experts.down_proj [E, D, Fe] -> [E, Fe, D]."""
  return Recipe(
      (source,),
      ((experts, hidden, moe_dim),),
      ((target, (experts, moe_dim, hidden)),),
      lambda read, dt: (_cast(read(0).transpose(0, 2, 1), dt),),
  )


def _interleaved_gate_up(source: str, shape: Shape, gate: str, up: str) -> Recipe:
  """gpt-oss gate_up_proj [..., 2*Fe] (or its bias), gate at even and up at odd positions of the last axis."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    return _cast(w[..., 0::2], dt), _cast(w[..., 1::2], dt)

  half = shape[:-1] + (shape[-1] // 2,)
  return Recipe((source,), (shape,), ((gate, half), (up, half)), convert)


def _gpt_oss_moe(cfg: Any, i: int, available: Collection[str]) -> list[Recipe]:
  p, c = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
  d, e, fe = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
  if p + "experts.gate_up_proj_blocks" in available:
    raise NotImplementedError(
        f"layer {i}: MXFP4-quantised gpt-oss experts (experts.gate_up_proj_blocks / _scales) are not supported;"
        " load a dequantised checkpoint (transformers save_pretrained of the bf16 model)"
    )
  return [
      _linear(p + "router.weight", e, d, c + "router.kernel"),
      _same(p + "router.bias", (e,), c + "router.bias"),
      _interleaved_gate_up(p + "experts.gate_up_proj", (e, d, 2 * fe), c + "gate", c + "up"),
      _interleaved_gate_up(p + "experts.gate_up_proj_bias", (e, 2 * fe), c + "gate_bias", c + "up_bias"),
      _same(p + "experts.down_proj", (e, fe, d), c + "down"),
      _same(p + "experts.down_proj_bias", (e, d), c + "down_bias"),
  ]


def _attention(cfg: Any, i: int) -> list[Recipe]:
  p, c = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
  d, hq, hkv, dh = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
  shared = cfg.kv_shared_source[i] >= 0
  if cfg.use_attention_output_gate and cfg.attention_bias:
    raise NotImplementedError(
        f"layer {i}: attention_bias with the gated attention of decoder_block={cfg.decoder_block!r} is not supported"
    )
  if cfg.use_attention_output_gate:
    recipes = [_gated_q(p + "q_proj.weight", hq, dh, d, c + "q.kernel", c + "gate.kernel")]
  else:
    recipes = [_heads_in(p + "q_proj.weight", hq, dh, d, c + "q.kernel")]
  kv = () if shared else ("k", "v")
  recipes += [_heads_in(p + f"{n}_proj.weight", hkv, dh, d, c + f"{n}.kernel") for n in kv]
  recipes.append(_o_proj(p + "o_proj.weight", hq, dh, d, c + "o.kernel"))
  if cfg.attention_bias:
    recipes.append(_head_bias(p + "q_proj.bias", hq, dh, c + "q.bias"))
    recipes += [_head_bias(p + f"{n}_proj.bias", hkv, dh, c + f"{n}.bias") for n in kv]
    recipes.append(_same(p + "o_proj.bias", (d,), c + "o.bias"))
  if cfg.use_attention_sinks:
    recipes.append(_same(p + "sinks", (hq,), c + "sinks"))
  if cfg.use_qk_norm:
    recipes.append(_same(p + "q_norm.weight", (dh,), c + "q_norm.scale"))
    if not shared:
      recipes.append(_same(p + "k_norm.weight", (dh,), c + "k_norm.scale"))
  return recipes


def _gated_delta_net(cfg: Any, i: int) -> list[Recipe]:
  p, c = f"model.layers.{i}.linear_attn.", f"layers.{i}.gdn."
  d = cfg.base_emb_dim
  nk, nv, hk, hv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
  conv_dim = cfg.gdn_conv_dim
  if families.get_family(cfg.decoder_block).tensors.gdn_projections == GDN_GROUPED:
    recipes = [
        _grouped_qkvz(p + "in_proj_qkvz.weight", nk, nv, hk, hv, d, c + "qkv.kernel", c + "z.kernel"),
        _grouped_ba(p + "in_proj_ba.weight", nk, nv, d, c + "b.kernel", c + "a.kernel"),
    ]
  else:
    recipes = [
        _linear(p + "in_proj_qkv.weight", conv_dim, d, c + "qkv.kernel"),
        _linear(p + "in_proj_z.weight", nv * hv, d, c + "z.kernel"),
        _linear(p + "in_proj_b.weight", nv, d, c + "b.kernel"),
        _linear(p + "in_proj_a.weight", nv, d, c + "a.kernel"),
    ]
  return recipes + [
      _conv(p + "conv1d.weight", conv_dim, cfg.gdn_conv_kernel_dim, c + "conv.kernel"),
      _same(p + "A_log", (nv,), c + "A_log"),
      _same(p + "dt_bias", (nv,), c + "dt_bias"),
      _same(p + "norm.weight", (hv,), c + "norm.scale"),
      _linear(p + "out_proj.weight", d, nv * hv, c + "out.kernel"),
  ]


def _split_rows(source: str, sizes: Sequence[int], hidden: int | None, targets: Sequence[str]) -> Recipe:
  """A Linear weight [sum(sizes), D] (or its bias [sum(sizes)] when `hidden` is None) split by rows -> kernels
  [D, size] (or biases [size]), one per target."""
  total = sum(sizes)
  bounds = np.cumsum([0, *sizes])

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    parts = [w[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    return tuple(_cast(part if hidden is None else part.T, dt) for part in parts)

  if hidden is None:
    return Recipe((source,), ((total,),), tuple((t, (n,)) for t, n in zip(targets, sizes)), convert)
  return Recipe((source,), ((total, hidden),), tuple((t, (hidden, n)) for t, n in zip(targets, sizes)), convert)


def _mamba2(cfg: Any, i: int) -> list[Recipe]:
  p, c = f"model.layers.{i}.mamba.", f"layers.{i}.mamba."
  d, nh, inner, conv_dim = cfg.base_emb_dim, cfg.mamba_num_heads, cfg.mamba_inner_dim, cfg.mamba_conv_dim
  names = (c + "z", c + "xbc", c + "dt")
  recipes = [
      _split_rows(p + "in_proj.weight", (inner, conv_dim, nh), d, [n + ".kernel" for n in names]),
      _conv(p + "conv1d.weight", conv_dim, cfg.mamba_conv_kernel_dim, c + "conv.kernel"),
      _same(p + "A_log", (nh,), c + "A_log"),
      _same(p + "D", (nh,), c + "D"),
      _same(p + "dt_bias", (nh,), c + "dt_bias"),
      _same(p + "norm.weight", (inner,), c + "norm.scale"),
      _linear(p + "out_proj.weight", d, inner, c + "out.kernel"),
  ]
  if cfg.mamba_conv_bias:
    recipes.append(_same(p + "conv1d.bias", (conv_dim,), c + "conv.bias"))
  if cfg.mamba_proj_bias:
    recipes.append(_split_rows(p + "in_proj.bias", (inner, conv_dim, nh), None, [n + ".bias" for n in names]))
    recipes.append(_same(p + "out_proj.bias", (d,), c + "out.bias"))
  return recipes


def _granite_ffn(cfg: Any, i: int, available: Collection[str]) -> list[Recipe]:
  """Granite 4.0: the shared MLP (fused input_linear) and, with experts, the routed experts beside it."""
  p = f"model.layers.{i}."
  d = cfg.base_emb_dim
  if not cfg.moe_layers[i]:
    c, f = f"layers.{i}.mlp.", cfg.base_mlp_dim
    return [
        _split_rows(p + "shared_mlp.input_linear.weight", (f, f), d, [c + "gate.kernel", c + "up.kernel"]),
        _linear(p + "shared_mlp.output_linear.weight", d, f, c + "down.kernel"),
    ]
  m, c = p + "block_sparse_moe.", f"layers.{i}.moe."
  e, fe, fs = cfg.num_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_mlp_dim
  router = m + "router.layer.weight" if m + "router.layer.weight" in available else m + "router.weight"
  fused = m + "input_linear.weight" in available
  gate_up = m + "input_linear.weight" if fused else m + "experts.gate_up_proj"
  down = m + "output_linear.weight" if fused else m + "experts.down_proj"
  return [
      _linear(router, e, d, c + "router.kernel"),
      _fused_gate_up(gate_up, e, fe, d, c + "gate", c + "up"),
      _fused_down(down, e, fe, d, c + "down"),
      _split_rows(p + "shared_mlp.input_linear.weight", (fs, fs), d, [c + "shared.gate.kernel", c + "shared.up.kernel"]),
      _linear(p + "shared_mlp.output_linear.weight", d, fs, c + "shared.down.kernel"),
  ]


def _dense_mlp(prefix: str, canonical: str, hidden: int, mlp_dim: int, bias: bool) -> list[Recipe]:
  recipes = [
      _linear(prefix + "gate_proj.weight", mlp_dim, hidden, canonical + "gate.kernel"),
      _linear(prefix + "up_proj.weight", mlp_dim, hidden, canonical + "up.kernel"),
      _linear(prefix + "down_proj.weight", hidden, mlp_dim, canonical + "down.kernel"),
  ]
  if bias:
    recipes += [
        _same(prefix + "gate_proj.bias", (mlp_dim,), canonical + "gate.bias"),
        _same(prefix + "up_proj.bias", (mlp_dim,), canonical + "up.bias"),
        _same(prefix + "down_proj.bias", (hidden,), canonical + "down.bias"),
    ]
  return recipes


def _moe(cfg: Any, i: int, available: Collection[str]) -> list[Recipe]:
  if cfg.use_moe_bias:
    return _gpt_oss_moe(cfg, i, available)
  p, c = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
  d, e, fe, fs = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_mlp_dim
  recipes = [_linear(p + "gate.weight", e, d, c + "router.kernel")]
  if p + "experts.gate_up_proj" in available:
    recipes += [
        _fused_gate_up(p + "experts.gate_up_proj", e, fe, d, c + "gate", c + "up"),
        _fused_down(p + "experts.down_proj", e, fe, d, c + "down"),
    ]
  else:
    experts = [f"{p}experts.{j}." for j in range(e)]
    recipes += [
        _stacked([x + "gate_proj.weight" for x in experts], fe, d, c + "gate"),
        _stacked([x + "up_proj.weight" for x in experts], fe, d, c + "up"),
        _stacked([x + "down_proj.weight" for x in experts], d, fe, c + "down"),
    ]
  if fs > 0:
    recipes += _dense_mlp(p + "shared_expert.", c + "shared.", d, fs, False)
    recipes.append(_linear(p + "shared_expert_gate.weight", 1, d, c + "shared_gate.kernel"))
  return recipes


def _mlp_or_moe(cfg: Any, i: int, available: Collection[str]) -> list[Recipe]:
  """`mlp.`: the routed experts on the config's MoE layers, the dense MLP elsewhere."""
  if cfg.moe_layers[i]:
    return _moe(cfg, i, available)
  return _dense_mlp(f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_bias)


def _feed_forward(cfg: Any, i: int, available: Collection[str]) -> list[Recipe]:
  """`feed_forward.`: a dense MLP on every layer."""
  del available  # one layout only
  return _dense_mlp(
      f"model.layers.{i}.feed_forward.", f"layers.{i}.mlp.", cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_bias
  )


# The feed-forward layouts a family names in `TensorLayout.ffn`: (cfg, layer index, available names) -> recipes.
FFN_RECIPES: dict[str, Callable[[Any, int, Collection[str]], list[Recipe]]] = {
    FFN_MLP: _mlp_or_moe,
    FFN_FEED_FORWARD: _feed_forward,
    FFN_GRANITE: _granite_ffn,
}

# The checkpoint mapping of each layer kind's mixer: (cfg, layer index) -> its recipes.
MIXER_RECIPES: dict[str, Callable[[Any, int], list[Recipe]]] = {
    FULL_ATTENTION: _attention,
    SLIDING_ATTENTION: _attention,
    LINEAR_ATTENTION: _gated_delta_net,
    MAMBA: _mamba2,
}


def _mixer_recipes(cfg: Any, i: int, kind: str) -> list[Recipe]:
  if kind not in MIXER_RECIPES:
    raise NotImplementedError(
        f"layer {i} is {kind!r}, which has no Hugging Face checkpoint mapping (mapped kinds:"
        f" {', '.join(sorted(MIXER_RECIPES))})"
    )
  return MIXER_RECIPES[kind](cfg, i)


def build_recipes(cfg: Any, available: Collection[str] = ()) -> list[Recipe]:
  """Every recipe of a model config, in layer order.

  Args:
    cfg: a loaded config (`maxtext.configs.load_config`), with derived values.
    available: normalised names present in the checkpoint (selects the per-expert or fused MoE layout).

  Returns:
    The recipes; together their targets are every canonical parameter of the model.

  Raises:
    NotImplementedError: the config asks for a layout no Hugging Face checkpoint of these families has, or a
      layer kind without a checkpoint mapping.

  The family of `cfg.decoder_block` names its layout (`TensorLayout`: norm names, feed-forward and delta net
  projection layouts); the mixer of each layer kind maps its own tensors (`MIXER_RECIPES`).
  """
  d, v = cfg.base_emb_dim, cfg.vocab_size
  layout = families.get_family(cfg.decoder_block).tensors
  ffn = FFN_RECIPES[layout.ffn]
  recipes = [_same("model.embed_tokens.weight", (v, d), "embedder.embedding")]
  for i, kind in enumerate(cfg.layer_types):
    p, c = f"model.layers.{i}.", f"layers.{i}."
    recipes.append(_same(p + "input_layernorm.weight", (d,), c + "input_norm.scale"))
    if cfg.use_sandwich_norm:
      recipes += [
          _same(p + "post_attention_layernorm.weight", (d,), c + "post_attn_norm.scale"),
          _same(p + "pre_feedforward_layernorm.weight", (d,), c + "pre_mlp_norm.scale"),
          _same(p + "post_feedforward_layernorm.weight", (d,), c + "post_mlp_norm.scale"),
      ]
    else:
      recipes.append(_same(p + layout.pre_mlp_norm + ".weight", (d,), c + "pre_mlp_norm.scale"))
    recipes += _mixer_recipes(cfg, i, kind)
    recipes += ffn(cfg, i, available)
  recipes.append(_same(layout.final_norm, (d,), "final_norm.scale"))
  if not cfg.logits_via_embedding:
    recipes.append(_linear("lm_head.weight", v, d, "lm_head.kernel"))
  return recipes
