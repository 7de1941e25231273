"""maxtext.layers."""
