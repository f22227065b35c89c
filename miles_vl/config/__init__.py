"""Job configuration: YAML + command-line overrides -> a validated, typed `JobConfig`."""

from miles_vl.config.loader import ConfigError, load_config, load_run_config, redact_overrides
from miles_vl.config.schema import JobConfig, redacted

__all__ = ["ConfigError", "JobConfig", "load_config", "load_run_config", "redact_overrides", "redacted"]
