"""Train types, registered by name (`train.train_type`)."""

from astrai.strategies import dpo, grpo, language_modeling, ppo  # noqa: F401  (registers seq, sft, dpo, grpo, online_ppo)
from astrai.strategies.base import REGISTRY, StepOutput, Strategy, register, strategy_class

__all__ = ["REGISTRY", "StepOutput", "Strategy", "register", "strategy_class"]
