"""AstrAI: a DeepSpeed-backed trainer for large language models."""

__version__ = "0.1.0"
