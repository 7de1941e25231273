"""The configuration error type."""


class ConfigError(ValueError):
  """A configuration key is unknown, mistyped, set twice, or inconsistent with another key."""
