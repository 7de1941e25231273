"""maxtext.models."""
