"""maxtext.inference: the CPU reference runner (block pools, KV-cache manager, scheduler, metadata, sampler), and
the `LLM` / `SamplingParams` offline API shaped like vLLM's."""

from maxtext.inference.llm import LLM
from maxtext.inference.outputs import CompletionOutput, Logprob, RequestOutput
from maxtext.inference.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
