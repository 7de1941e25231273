"""An index of the tensors of a local Hugging Face folder (one or more safetensors files), read one at a time.

Only headers are read when the index is built; `read` loads a single tensor. Names are normalised to the text-model
layout (`model.layers...`, `lm_head.weight`): multimodal prefixes (`model.language_model.`, `language_model.model.`)
are stripped, and tensors this package never uses (vision tower, projector, multi-token prediction heads, cached
rotary tables) are skipped.
"""

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes numpy reads natively; BF16 goes through JAX (numpy has no bfloat16 of its own).
_NUMPY_DTYPES = ("F64", "F32", "F16")
_FLOAT_DTYPES = _NUMPY_DTYPES + ("BF16",)
# (prefix on disk, prefix in the normalised name); the first match wins.
_PREFIX_REWRITES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_IGNORED_PREFIXES = (
    "mtp.",
    "model.mtp.",
    "visual.",
    "model.visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives and what its header says."""

  name: str  # name as stored in the file
  file: str  # path of the safetensors file
  shape: tuple[int, ...]
  dtype: str  # safetensors dtype string, e.g. "F32", "BF16"


def normalize_name(name: str) -> str | None:
  """The text-model name of a stored tensor, or None when the tensor is not used by this package."""
  if name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
    return None
  for old, new in _PREFIX_REWRITES:
    if name.startswith(old):
      return new + name[len(old) :]
  return name


def _list_files(folder: str) -> list[str]:
  """The safetensors files of a folder: those of the sharded index if present, else every *.safetensors."""
  if os.path.isfile(folder):
    raise ValueError(
        f"hf_model_path={folder!r} is a file, not a folder; give the Hugging Face folder holding config.json,"
        " *.safetensors and tokenizer.json"
        + ("; a GGUF file is given as gguf_model_path" if folder.lower().endswith(".gguf") else "")
    )
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"Hugging Face model folder {folder!r} does not exist")
  index_path = os.path.join(folder, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path, encoding="utf-8") as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index_path} must have a non-empty 'weight_map' object")
    names = sorted(set(weight_map.values()))
    for name in names:
      if not os.path.isfile(os.path.join(folder, name)):
        raise FileNotFoundError(f"{index_path} lists {name!r}, which is not in {folder!r}")
    return [os.path.join(folder, name) for name in names]
  names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
  if not names:
    raise FileNotFoundError(f"Hugging Face model folder {folder!r} has no *.safetensors files")
  return [os.path.join(folder, name) for name in names]


class SafetensorsIndex(contextlib.AbstractContextManager):
  """Normalised name -> tensor, over every safetensors file of a folder. Use as a context manager.

  Attributes:
    folder: the folder.
    tensors: {normalised name: TensorInfo}.
  """

  def __init__(self, folder: str | os.PathLike):
    self.folder = os.fspath(folder)
    self.tensors: dict[str, TensorInfo] = {}
    self._handles: dict[tuple[str, str], Any] = {}
    self._stack = contextlib.ExitStack()
    skipped = 0
    for path in _list_files(self.folder):
      handle = self._open(path, "np")
      for name in handle.keys():
        key = normalize_name(name)
        if key is None:
          skipped += 1
          continue
        tensor_slice = handle.get_slice(name)
        info = TensorInfo(name, path, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
        if key in self.tensors:
          other = self.tensors[key]
          raise ValueError(
              f"tensor {name!r} in {os.path.basename(path)} and {other.name!r} in {os.path.basename(other.file)} "
              f"both map to {key!r}; a checkpoint must hold each tensor once"
          )
        self.tensors[key] = info
    if skipped:
      logger.info("skipped %d tensors not used by a text model (vision, mtp) in %s", skipped, self.folder)

  def _open(self, path: str, framework: str) -> Any:
    key = (path, framework)
    if key not in self._handles:
      try:
        handle = safe_open(path, framework=framework)
      except SafetensorError as e:
        raise ValueError(
            f"{os.path.basename(path)} in {self.folder!r} is not a readable safetensors file (truncated or"
            f" corrupt?): {e}"
        ) from None
      self._handles[key] = self._stack.enter_context(handle)
    return self._handles[key]

  def read(self, key: str) -> np.ndarray:
    """Loads one tensor by its normalised name, in its stored dtype (bfloat16 as ml_dtypes.bfloat16).

    Raises:
      ValueError: the tensor is not a floating-point tensor.
    """
    info = self.tensors[key]
    if info.dtype not in _FLOAT_DTYPES:
      raise ValueError(
          f"tensor {info.name!r} in {os.path.basename(info.file)} has dtype {info.dtype}; "
          f"weights must be one of {', '.join(_FLOAT_DTYPES)}"
      )
    if info.dtype in _NUMPY_DTYPES:
      return self._open(info.file, "np").get_tensor(info.name)
    return np.asarray(self._open(info.file, "flax").get_tensor(info.name))

  def close(self) -> None:
    """Closes every open file."""
    self._stack.close()
    self._handles.clear()

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
