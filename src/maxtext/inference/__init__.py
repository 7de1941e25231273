"""maxtext.inference: the CPU reference runner (block pools, KV-cache manager, scheduler, metadata, sampler), and
the `LLM` / `SamplingParams` offline API shaped like vLLM's."""

from maxtext.inference.llm import LLM, CompletionOutput, RequestOutput
from maxtext.inference.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
