"""maxtext.inference: the CPU reference runner (block pools, KV-cache manager, scheduler, metadata, sampler)."""

from maxtext.inference.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
