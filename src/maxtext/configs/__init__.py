"""maxtext.configs."""
