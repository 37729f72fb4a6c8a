"""Job configuration: typed schema (`schema.py`) and the YAML loader with overrides (`loader.py`)."""

from astrai.config.loader import ConfigError, dump_job, load_job, parse_yaml, resolve_template
from astrai.config.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "dump_job", "load_job", "parse_yaml", "resolve_template"]
