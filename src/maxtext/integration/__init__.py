"""maxtext.integration."""
