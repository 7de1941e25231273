"""maxtext.checkpoint."""
