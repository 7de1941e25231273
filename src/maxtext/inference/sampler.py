"""Next-token sampling from logits (NumPy, float64, deterministic).

Per request row: temperature 0 -> argmax (lowest id on ties). Otherwise the logits are divided by the temperature,
top-k keeps the k most likely tokens (ties broken by lower id), top-p keeps the smallest prefix of the remaining
tokens, most likely first, whose probability (renormalised after top-k) sums to at least p, and one token is drawn
from the renormalised kept set by inverse CDF with a uniform number from the request's generator.

Generators: a request with a seed draws from `numpy.random.default_rng([seed, step])` where `step` is the number of
tokens it generated before, so its tokens do not depend on the rest of the batch (or on preemption). Unseeded
requests share the sampler's generator, seeded once by the sampler's seed.

Logprobs (`SamplingParams.logprobs = n`): log_softmax of the RAW logits (before temperature / top-k / top-p), the
sampled token's value and the n largest (ties broken by lower id).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxtext.inference.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Log-probabilities at one sampled position.

  Attributes:
    token_id: the sampled token.
    logprob: its log-probability under the raw logits.
    top: the n most likely (token id, log-probability) pairs, most likely first.
  """

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
  """Sampled tokens of a batch.

  Attributes:
    token_ids: [R] int64, one per row.
    logprobs: per row, TokenLogprobs or None when the request asked for none.
  """

  token_ids: np.ndarray
  logprobs: tuple[TokenLogprobs | None, ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """Numerically stable log-softmax over the last axis, in float64."""
  x = np.asarray(logits, np.float64)
  shifted = x - np.max(x, axis=-1, keepdims=True)
  return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
  """The kept tokens (most likely first) and their renormalised probabilities for a non-greedy request.

  Args:
    logits: [V] raw logits of one row.
    params: temperature > 0, top_k, top_p.

  Returns:
    (token ids [N], probabilities [N]) with N >= 1 and the probabilities summing to 1.
  """
  scaled = np.asarray(logits, np.float64) / params.temperature
  order = np.lexsort((np.arange(scaled.shape[0]), -scaled))  # descending value, then ascending id
  if params.top_k != -1:
    order = order[: params.top_k]
  probs = np.exp(scaled[order] - scaled[order[0]])
  probs /= probs.sum()
  if params.top_p < 1.0:
    cumulative = np.cumsum(probs)
    keep = min(int(np.searchsorted(cumulative, params.top_p, side="left")) + 1, len(order))
    order, probs = order[:keep], probs[:keep]
    probs = probs / probs.sum()
  return order, probs


class Sampler:
  """Samples one token per row of a batch of logits.

  Args:
    seed: seeds the generator shared by requests without their own seed.
  """

  def __init__(self, seed: int = 0):
    self._rng = np.random.default_rng(seed)

  def sample(
      self,
      logits: Any,
      sampling_params: Sequence[SamplingParams],
      step_indices: Sequence[int],
  ) -> SamplerOutput:
    """Samples a token per row.

    Args:
      logits: [R, V] logits (NumPy or JAX, any float dtype); only the R real rows.
      sampling_params: R parameter sets, one per row.
      step_indices: R ints, the number of tokens each request generated before this one.

    Raises:
      ValueError: logits are not rank 2, the lengths disagree, or a row is not finite.
    """
    logits = np.asarray(logits, np.float64)
    if logits.ndim != 2:
      raise ValueError(f"logits must have shape [R, V], got {logits.shape}")
    rows = logits.shape[0]
    if len(sampling_params) != rows or len(step_indices) != rows:
      raise ValueError(
          f"need one SamplingParams and one step index per logits row: {rows} rows, {len(sampling_params)} params,"
          f" {len(step_indices)} step indices"
      )
    tokens = np.zeros((rows,), np.int64)
    logprobs = []
    for i, (params, step) in enumerate(zip(sampling_params, step_indices)):
      row = logits[i]
      if not np.all(np.isfinite(row)):
        raise ValueError(f"logits row {i} holds non-finite values (NaN or inf); the model output is broken")
      if params.is_greedy:
        token = int(np.argmax(row))
      else:
        rng = self._rng if params.seed is None else np.random.default_rng([params.seed, step])
        ids, probs = filtered_probs(row, params)
        index = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
        token = int(ids[min(index, len(ids) - 1)])
      tokens[i] = token
      logprobs.append(None if params.logprobs is None else token_logprobs(row, token, params.logprobs))
    return SamplerOutput(token_ids=tokens, logprobs=tuple(logprobs))


def token_logprobs(logits: np.ndarray, token_id: int, num_top: int) -> TokenLogprobs:
  """The sampled token's log-probability and the `num_top` largest, from raw logits [V]."""
  values = log_softmax(logits)
  top = np.lexsort((np.arange(values.shape[0]), -values))[:num_top]
  return TokenLogprobs(
      token_id=int(token_id),
      logprob=float(values[token_id]),
      top=tuple((int(t), float(values[t])) for t in top),
  )
