"""The error types of user input and of the environment."""


class ConfigError(ValueError):
  """A configuration key is unknown, mistyped, set twice, or inconsistent with another key."""


class MissingDependencyError(RuntimeError):
  """An optional package that the requested feature needs is not installed (the message names it)."""
