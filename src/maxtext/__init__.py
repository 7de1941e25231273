"""maxtext: MaxText-style hybrid JAX models for vLLM's TPU runner, with a CPU reference runner."""

__version__ = "0.1.0"
