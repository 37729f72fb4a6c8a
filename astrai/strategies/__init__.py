"""Train types, registered by name (`train.train_type`)."""

from astrai.strategies import language_modeling  # noqa: F401  (registers seq, sft)
from astrai.strategies.base import REGISTRY, StepOutput, Strategy, register, strategy_class

__all__ = ["REGISTRY", "StepOutput", "Strategy", "register", "strategy_class"]
