"""Shared pytest setup: fake CPU devices for sharding code, float32 matmuls at full precision."""

import jax

# Sharding code runs on fake CPU devices; this must happen before JAX initialises its backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
