"""Job configuration: YAML + command-line overrides -> a validated, typed `JobConfig`."""

from miles_vl.config.loader import ConfigError, load_config, load_raw, validate
from miles_vl.config.schema import REDACTED, JobConfig, cross_field_errors, redacted, secret_keys

__all__ = [
    "REDACTED",
    "ConfigError",
    "JobConfig",
    "cross_field_errors",
    "load_config",
    "load_raw",
    "redacted",
    "secret_keys",
    "validate",
]
