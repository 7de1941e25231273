"""maxtext.integration.vllm."""
