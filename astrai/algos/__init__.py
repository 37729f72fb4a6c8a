"""Pure tensor math (imports only torch): losses, log-probs, KL estimators, advantages, PPO.

Every formula is tested against hand-computed numbers or an independent loop implementation.
"""

from astrai.algos.advantages import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
)
from astrai.algos.cross_entropy import next_token_cross_entropy_sum
from astrai.algos.dpo import DPOOutput, dpo_loss
from astrai.algos.kl import kl_estimate, kl_k1, kl_k2, kl_k3
from astrai.algos.logprobs import sequence_logprobs, shift_for_next_token, token_logprobs
from astrai.algos.masked import (
    global_standardize,
    masked_aggregate,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from astrai.algos.ppo import (
    broadcast_sequence_advantages,
    entropy_from_logits,
    explained_variance,
    explained_variance_from_sums,
    ppo_policy_loss,
    value_loss,
)

__all__ = [
    "AdaptiveKLController",
    "DPOOutput",
    "FixedKLController",
    "broadcast_sequence_advantages",
    "compute_gae",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "explained_variance_from_sums",
    "gae",
    "global_standardize",
    "grpo_advantages",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_shaped_rewards",
    "masked_aggregate",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_token_cross_entropy_sum",
    "ppo_policy_loss",
    "sequence_logprobs",
    "shift_for_next_token",
    "token_logprobs",
    "value_loss",
]
