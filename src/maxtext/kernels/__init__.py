"""maxtext.kernels."""
