"""One module per section of the job YAML; `astrai/config/schema.py` composes them into the job and re-exports
every section class, so `from astrai.config.schema import RlConfig` stays the one import path."""
