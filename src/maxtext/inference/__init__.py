"""maxtext.inference."""
