"""Rollouts for the online train types: prompts, generation with behaviour log-probs, rewards.

`sequences` is the one home of the prompt + response layout and its log-probs; `generation` samples
and returns a `RolloutResult`; `rewards` turns responses into floats. `grpo` and `online_ppo` both
call these; nothing here knows which train type is running.
"""

from astrai.rollout.generation import RolloutResult, generate_rollout, sampling_seed
from astrai.rollout.rewards import RewardError, RewardScores, build_reward, reward_inputs
from astrai.rollout.sequences import (
    frozen_response_values,
    join_sequences,
    left_pad,
    response_logits,
    response_logprobs,
    response_mask,
    response_values,
)

__all__ = [
    "RewardError",
    "RewardScores",
    "RolloutResult",
    "build_reward",
    "frozen_response_values",
    "generate_rollout",
    "join_sequences",
    "left_pad",
    "response_logits",
    "response_logprobs",
    "response_mask",
    "response_values",
    "reward_inputs",
    "sampling_seed",
]
