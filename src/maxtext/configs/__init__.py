"""Configuration: base YAML, model YAML and `key=value` overrides, validated and with derived values."""

from maxtext.configs.errors import ConfigError
from maxtext.configs.loader import BASE_CONFIG_PATH, available_models, config_to_dict, load_config

__all__ = ["BASE_CONFIG_PATH", "ConfigError", "available_models", "config_to_dict", "load_config"]
