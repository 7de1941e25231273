"""maxtext.testing."""
