"""maxtext.integration.vllm: the runner-facing model, its plugin and the tpu-inference kernel backend."""

# Registers kernel_backend=tpu_inference (the backend imports tpu-inference only when it is built).
from maxtext.integration.vllm import tpu_inference_backend
