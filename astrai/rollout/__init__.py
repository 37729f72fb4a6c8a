"""Rollouts for the online train types: prompts, generation with behaviour log-probs, rewards.

`sequences` is the one home of the prompt + response layout; `scoring` the one home of the forward that scores
it (log-probs, entropy, critic values), chosen once from the job; `generation` samples and returns a
`RolloutResult`; `rewards` turns responses into floats. `grpo` and `online_ppo` both call these; nothing here
knows which train type is running.
"""

from astrai.rollout.generation import RolloutResult, generate_rollout, sampling_seed
from astrai.rollout.prompts import Prompts
from astrai.rollout.rewards import RewardError, RewardScores, build_reward, reward_inputs
from astrai.rollout.scoring import (
    PackedForward,
    PlainForward,
    ScoringForward,
    SharedPrefixForward,
    scoring_forward,
)
from astrai.rollout.sequences import join_sequences, left_pad, response_mask

__all__ = [
    "PackedForward",
    "PlainForward",
    "Prompts",
    "RewardError",
    "RewardScores",
    "RolloutResult",
    "ScoringForward",
    "SharedPrefixForward",
    "build_reward",
    "generate_rollout",
    "join_sequences",
    "left_pad",
    "response_mask",
    "reward_inputs",
    "sampling_seed",
    "scoring_forward",
]
