"""Job configuration: YAML + command-line overrides -> a validated, typed `JobConfig`."""

from miles_vl.config.loader import ConfigError, load_config, load_raw, validate
from miles_vl.config.schema import JobConfig, cross_field_errors

__all__ = ["ConfigError", "JobConfig", "cross_field_errors", "load_config", "load_raw", "validate"]
