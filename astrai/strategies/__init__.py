"""Train types, registered by name (`train.train_type`)."""

from astrai.strategies import (  # noqa: F401  (registers seq, sft, dpo, grpo, online_ppo, rm)
    dpo,
    grpo,
    language_modeling,
    ppo,
    reward_model,
)
from astrai.strategies.base import REGISTRY, StepOutput, Strategy, register, strategy_class

__all__ = ["REGISTRY", "StepOutput", "Strategy", "register", "strategy_class"]
