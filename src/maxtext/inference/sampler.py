"""Next-token sampling from logits (NumPy, float64, deterministic).

Per request row, in vLLM's order: `min_tokens` sets the logits of the stop tokens (eos unless `ignore_eos`, and
`stop_token_ids`) to -inf while the output is shorter; the repetition penalty divides a positive logit (multiplies a
negative one) of every token in the prompt or the output, the frequency penalty subtracts once per occurrence in the
output and the presence penalty once per token present. A greedy row then takes the argmax (lowest id on ties).
Otherwise the logits are divided by the temperature, min-p drops the tokens less likely than min_p times the most
likely one, top-k keeps the k most likely tokens (ties broken by lower id), top-p keeps the smallest prefix of the
remaining tokens, most likely first, whose probability (renormalised) sums to at least p, and one token is drawn
from the renormalised kept set by inverse CDF with a uniform number from the request's generator.

Generators: a request with a seed draws from `numpy.random.default_rng([seed, step])` where `step` is the number of
tokens it generated before, so its tokens do not depend on the rest of the batch (or on preemption). Unseeded
requests share the sampler's generator, seeded once by the sampler's seed.

Logprobs (`SamplingParams.logprobs = n`): log_softmax of the RAW logits (before penalties, temperature and the
filters), the sampled token's value and rank and the n largest (ties broken by lower id), as vLLM reports them.
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
    rank: the sampled token's rank under the raw logits (1 = most likely; 1 + the number of tokens more likely).
  """

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...]
  rank: int = 1


@dataclasses.dataclass(frozen=True)
class TokenHistory:
  """What a row's penalties read: the request's prompt and the tokens it generated so far."""

  prompt_token_ids: Sequence[int]
  output_token_ids: Sequence[int]


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


def processed_logits(
    logits: np.ndarray, params: SamplingParams, history: TokenHistory | None, stop_ids: Sequence[int]
) -> np.ndarray:
  """One row's logits after `min_tokens` and the penalties (a copy; the raw row is what logprobs read).

  Args:
    logits: [V] raw logits.
    params: the request's parameters.
    history: its prompt and output so far (needed when `params.has_penalties`).
    stop_ids: the tokens that would finish it (eos unless ignored, and `stop_token_ids`).

  Raises:
    ValueError: the parameters need a history and none is given.
  """
  x = np.array(logits, np.float64)
  if not params.has_penalties:
    return x
  if history is None:
    raise ValueError("penalties and min_tokens need the request's token history; none was given")
  vocab = x.shape[0]
  output = np.asarray(history.output_token_ids, np.int64)
  if len(output) < params.min_tokens:
    ids = np.asarray([t for t in stop_ids if 0 <= t < vocab], np.int64)
    x[ids] = -np.inf
  if params.repetition_penalty != 1.0:
    seen = np.zeros(vocab, bool)
    seen[np.asarray(history.prompt_token_ids, np.int64)] = True
    seen[output] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / params.repetition_penalty, x[seen] * params.repetition_penalty)
  counts = np.bincount(output, minlength=vocab)[:vocab].astype(np.float64)
  x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
  return x


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
  """The kept tokens (most likely first) and their renormalised probabilities for a non-greedy request.

  Args:
    logits: [V] logits of one row (after penalties).
    params: temperature > 0, min_p, top_k, top_p.

  Returns:
    (token ids [N], probabilities [N]) with N >= 1 and the probabilities summing to 1.
  """
  scaled = np.asarray(logits, np.float64) / params.temperature
  order = np.lexsort((np.arange(scaled.shape[0]), -scaled))  # descending value, then ascending id
  order = order[np.isfinite(scaled[order])][: max(1, int(np.isfinite(scaled).sum()))]
  if params.min_p > 0.0:  # p >= min_p * p_max  <=>  logit >= logit_max + log(min_p): a prefix of `order`
    order = order[: max(1, int(np.sum(scaled[order] >= scaled[order[0]] + np.log(params.min_p))))]
  if params.top_k > 0:
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
    eos_token_id: the end-of-sequence token, which `min_tokens` masks (unless a request ignores eos).
  """

  def __init__(self, seed: int = 0, eos_token_id: int | None = None):
    self._rng = np.random.default_rng(seed)
    self.eos_token_id = eos_token_id

  def sample(
      self,
      logits: Any,
      sampling_params: Sequence[SamplingParams],
      step_indices: Sequence[int],
      histories: Sequence[TokenHistory | None] | None = None,
  ) -> SamplerOutput:
    """Samples a token per row.

    Args:
      logits: [R, V] logits (NumPy or JAX, any float dtype); only the R real rows.
      sampling_params: R parameter sets, one per row.
      step_indices: R ints, the number of tokens each request generated before this one.
      histories: R token histories (None for a row without penalties or `min_tokens`), or None when no row has any.

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
    histories = histories if histories is not None else [None] * rows
    tokens = np.zeros((rows,), np.int64)
    logprobs = []
    for i, (params, step) in enumerate(zip(sampling_params, step_indices)):
      row = logits[i]
      if not np.all(np.isfinite(row)):
        raise ValueError(f"logits row {i} holds non-finite values (NaN or inf); the model output is broken")
      processed = processed_logits(row, params, histories[i], self._stop_ids(params))
      if params.is_greedy:
        token = int(np.argmax(processed))
      else:
        rng = self._rng if params.seed is None else np.random.default_rng([params.seed, step])
        ids, probs = filtered_probs(processed, params)
        index = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
        token = int(ids[min(index, len(ids) - 1)])
      tokens[i] = token
      logprobs.append(None if params.logprobs is None else token_logprobs(row, token, params.logprobs))
    return SamplerOutput(token_ids=tokens, logprobs=tuple(logprobs))

  def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
    if params.ignore_eos or self.eos_token_id is None:
      return params.stop_token_ids
    return (self.eos_token_id, *params.stop_token_ids)


def token_logprobs(logits: np.ndarray, token_id: int, num_top: int) -> TokenLogprobs:
  """A token's log-probability and rank and the `num_top` largest (ties broken by lower id), from raw logits [V]."""
  values = log_softmax(logits)
  return TokenLogprobs(
      token_id=int(token_id),
      logprob=float(values[token_id]),
      top=tuple((int(t), float(values[t])) for t in top_ids(values, num_top)),
      rank=int(np.sum(values > values[token_id])) + 1,
  )


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
  """The ids of the `k` largest of `values` [V], largest first, ties broken by lower id.

  A partition finds the k-th largest value first, so only the candidates at or above it are sorted (a prompt's
  log-probabilities need this once per position).
  """
  k = min(k, values.shape[0])
  if k <= 0:
    return np.zeros((0,), np.int64)
  kth = np.partition(values, values.shape[0] - k)[values.shape[0] - k]
  candidates = np.flatnonzero(values >= kth)
  return candidates[np.lexsort((candidates, -values[candidates]))][:k]
