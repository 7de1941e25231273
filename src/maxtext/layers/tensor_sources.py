"""The checkpoint tensors that fill a parameter, and how they are re-laid-out: the vocabulary of the layers'
parameter declarations (`declarations.py`), and the `Recipe` the checkpoint readers run.

Each builder returns a `Source`: the Hugging Face tensors it reads (checked against their expected shapes before
anything is loaded) and the parameters it makes (kernels `[in, out...]`). The layouts every family shares are here:
  - Linear [out, in] -> [in, out]; q/k/v_proj [H*Dh, D] -> [D, H, Dh] (and biases [H*Dh] -> [H, Dh]);
    o_proj [D, Hq*Dh] -> [Hq, Dh, D].
  - Gated q_proj [Hq*2*Dh, D], rows per head [q_h | gate_h] -> q and gate [D, Hq, Dh] (Qwen3-Next / Qwen3.5).
  - conv1d.weight [C, 1, K] -> [K, C].
  - A Linear weight (or bias) split by rows into several kernels (Mamba2's in_proj, Granite's fused MLP).
  - MoE experts, per-expert keys (`experts.{e}.gate_proj.weight`, as save_pretrained and the Hub write them) or the
    fused transformers 5 layout (`experts.gate_up_proj` [E, 2*Fe, D], `experts.down_proj` [E, D, Fe]) -> stacked
    [E, D, Fe] / [E, Fe, D], filled expert by expert into one preallocated array.
A layout only one family's checkpoints use sits with the layer that owns its parameters (Qwen3-Next's grouped
in_proj_qkvz in `gated_delta_net.py`, gpt-oss's interleaved experts in `moe.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Shape = tuple[int, ...]
# read(j) loads the j-th source tensor of a recipe in its stored dtype.
Reader = Callable[[int], np.ndarray]
# convert(read, dtype) -> one array per output, in order, of dtype `dtype`.
Convert = Callable[[Reader, Any], tuple[np.ndarray, ...]]


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
  convert: Convert


@dataclasses.dataclass(frozen=True, eq=False)
class Source:
  """Checkpoint tensors and the parameters they make. Compared by identity: the parameters that name one source
  object are filled by one read of its tensors.

  Attributes:
    tensors: Hugging Face names, relative to the declaring module's checkpoint prefix until nested.
    shapes: the on-disk shape of each tensor.
    outputs: the shape of each parameter it makes, in order.
    convert: (read, dtype) -> one array per output.
    refusal: when set, a layout this package does not load: building its recipe raises NotImplementedError with it.
  """

  tensors: tuple[str, ...]
  shapes: tuple[Shape, ...]
  outputs: tuple[Shape, ...]
  convert: Convert
  refusal: str = ""

  def under(self, prefix: str) -> Source:
    """The same source with every tensor name under `prefix`."""
    return dataclasses.replace(self, tensors=tuple(prefix + t for t in self.tensors))


def cast(x: np.ndarray, dtype: Any) -> np.ndarray:
  """`x` in `dtype`, C-contiguous (no copy when it already is both)."""
  return np.ascontiguousarray(x.astype(dtype, copy=False))


def refused(message: str) -> Source:
  """The source of a parameter whose checkpoint layout is not supported: building its recipe raises `message`."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    del read, dt  # never read: `declarations.recipes` raises first
    raise NotImplementedError(message)

  return Source((), (), ((),), convert, refusal=message)


def same(tensor: str, shape: Shape) -> Source:
  """A tensor stored as the parameter is."""
  return Source((tensor,), (shape,), (shape,), lambda read, dt: (cast(read(0), dt),))


def linear(tensor: str, out_dim: int, in_dim: int) -> Source:
  """Linear weight [out, in] -> kernel [in, out]."""
  return Source((tensor,), ((out_dim, in_dim),), ((in_dim, out_dim),), lambda read, dt: (cast(read(0).T, dt),))


def heads_in(tensor: str, heads: int, head_dim: int, hidden: int) -> Source:
  """q/k/v_proj [H*Dh, D] -> [D, H, Dh]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    return (cast(read(0).T.reshape(hidden, heads, head_dim), dt),)

  return Source((tensor,), ((heads * head_dim, hidden),), ((hidden, heads, head_dim),), convert)


def head_bias(tensor: str, heads: int, head_dim: int) -> Source:
  """q/k/v_proj.bias [H*Dh] -> [H, Dh]."""
  return Source(
      (tensor,),
      ((heads * head_dim,),),
      ((heads, head_dim),),
      lambda read, dt: (cast(read(0).reshape(heads, head_dim), dt),),
  )


def gated_q(tensor: str, heads: int, head_dim: int, hidden: int) -> Source:
  """Gated q_proj [Hq*2*Dh, D], rows per head [q_h | gate_h] -> q, gate [D, Hq, Dh] (parts 0 and 1)."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0).reshape(heads, 2, head_dim, hidden)
    return cast(w[:, 0].transpose(2, 0, 1), dt), cast(w[:, 1].transpose(2, 0, 1), dt)

  shape = (hidden, heads, head_dim)
  return Source((tensor,), ((heads * 2 * head_dim, hidden),), (shape, shape), convert)


def o_proj(tensor: str, heads: int, head_dim: int, hidden: int) -> Source:
  """o_proj [D, Hq*Dh] -> [Hq, Dh, D]."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    return (cast(read(0).T.reshape(heads, head_dim, hidden), dt),)

  return Source((tensor,), ((hidden, heads * head_dim),), ((heads, head_dim, hidden),), convert)


def depthwise_conv(tensor: str, channels: int, kernel: int) -> Source:
  """Depthwise conv1d.weight [C, 1, K] -> [K, C]."""
  return Source(
      (tensor,),
      ((channels, 1, kernel),),
      ((kernel, channels),),
      lambda read, dt: (cast(read(0)[:, 0, :].T, dt),),
  )


def split_rows(tensor: str, sizes: Sequence[int], hidden: int | None) -> Source:
  """A Linear weight [sum(sizes), D] (or its bias [sum(sizes)] when `hidden` is None) split by rows -> kernels
  [D, size] (or biases [size]), one part per size."""
  total = sum(sizes)
  bounds = np.cumsum([0, *sizes])

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    parts = [w[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    return tuple(cast(part if hidden is None else part.T, dt) for part in parts)

  if hidden is None:
    return Source((tensor,), ((total,),), tuple((n,) for n in sizes), convert)
  return Source((tensor,), ((total, hidden),), tuple((hidden, n) for n in sizes), convert)


def stacked(tensors: Sequence[str], out_dim: int, in_dim: int) -> Source:
  """Per-expert Linear weights [out, in] -> one [E, in, out] array, filled expert by expert."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    out = np.empty((len(tensors), in_dim, out_dim), dtype=dt)
    for e in range(len(tensors)):
      out[e] = read(e).T.astype(dt, copy=False)
    return (out,)

  shapes = tuple((out_dim, in_dim) for _ in tensors)
  return Source(tuple(tensors), shapes, ((len(tensors), in_dim, out_dim),), convert)


def fused_gate_up(tensor: str, experts: int, moe_dim: int, hidden: int) -> Source:
  """transformers 5 experts.gate_up_proj [E, 2*Fe, D] (gate rows first) -> gate, up [E, D, Fe] (parts 0, 1)."""

  def convert(read: Reader, dt: Any) -> tuple[np.ndarray, ...]:
    w = read(0)
    return cast(w[:, :moe_dim].transpose(0, 2, 1), dt), cast(w[:, moe_dim:].transpose(0, 2, 1), dt)

  shape = (experts, hidden, moe_dim)
  return Source((tensor,), ((experts, 2 * moe_dim, hidden),), (shape, shape), convert)


def fused_down(tensor: str, experts: int, moe_dim: int, hidden: int) -> Source:
  """transformers 5 experts.down_proj [E, D, Fe] -> [E, Fe, D]."""
  return Source(
      (tensor,),
      ((experts, hidden, moe_dim),),
      ((experts, moe_dim, hidden),),
      lambda read, dt: (cast(read(0).transpose(0, 2, 1), dt),),
  )
