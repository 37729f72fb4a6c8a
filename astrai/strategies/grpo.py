"""`grpo`: Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath), token-level and clipped.

For the G responses o_1..o_G to one prompt, with rewards r_i:

    A_i    = (r_i - mean(r)) / (std(r) + 1e-6)          (rl.normalize_advantage_std: false -> r_i - mean(r))
    ratio  = pi(o_i,t) / pi_old(o_i,t)                  (pi_old: the behaviour log-probs, frozen at rollout)
    loss_t = max(-A_i ratio, -A_i clip(ratio, 1 - eps_low, 1 + eps_high)) + kl_coef * k3(pi, pi_ref)_t

Other critic-free estimators (rl.advantage_estimator; docs/guides/rl.md):
    rloo                   A_i = r_i - mean_{j != i} r_j                  (Ahmadian et al. 2024)
    reinforce_pp_baseline  A_i,t = whiten_step(r_i - mean(r))            (Hu 2025; verl, OpenRLHF)
    reinforce_pp           A_t = whiten_step(sum_{s >= t} gamma^(s-t) r_s), r_s = -kl_coef * k1_s (+ r_i on the
                           last token): the KL moves from the loss into the reward; no group baseline
whiten_step: mean and unbiased std over every response token of the step on all ranks.
rl.importance_sampling: sequence replaces the token ratio by GSPO's sequence ratio (algos/ppo.py).

Departures from the paper, and defaults:
- Aggregation `token_mean` by default: the loss is summed over every response token of the optimizer
  step (all ranks, all micro-batches) and divided by their count once, as Dr. GRPO and DAPO argue:
  the paper's per-response mean gives each token of a long response less weight, which favours long
  wrong answers and short right ones. `sequence_mean` restores the paper's weighting.
- `clip_eps_high` (DAPO's clip-higher) may widen the upper bound; it defaults to `clip_eps_low`.
- The reference is evaluated once per rollout and frozen with the other targets; with kl_coef = 0 it
  is not built at all (no memory, no forward) and the `kl` metric is not logged.
- Log-probs are of the temperature-scaled policy (the distribution the tokens were drawn from).
- With one optimizer update per rollout (rl.epochs_per_rollout 1, one minibatch) every micro-batch's
  loss forward runs on the very weights that sampled, so pi_old = pi.detach(): the rollout skips the
  behaviour forward (~13% of rollout time) and the ratio is exactly 1, as in TRL's on-policy GRPO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from astrai.algos.advantages import discounted_returns, grpo_advantages, kl_shaped_rewards, rloo_advantages
from astrai.algos.kl import kl_estimate
from astrai.algos.masked import global_standardize, masked_sum
from astrai.algos.ppo import broadcast_sequence_advantages, ppo_policy_loss
from astrai.rollout import RolloutResult
from astrai.strategies.base import StepOutput, register
from astrai.strategies.online_base import OnlineStrategy
from astrai.strategies.targets import Targets
from astrai.train_types import GrpoRules

if TYPE_CHECKING:  # Run holds the strategy: named for annotations only, the strategies never import training/
    from astrai.training.run_parts import Run


@register
class GrpoStrategy(OnlineStrategy):
    name = "grpo"
    rules = GrpoRules

    def setup(self, run: Run) -> None:
        super().setup(run)
        if self.needs_reference(self.job):
            self.build_reference(run)

    def needs_behaviour_logprobs(self) -> bool:
        if self.kl_in_reward() and self.job.rl.kl_coef > 0:
            return True  # reinforce_pp's KL-shaped rewards read them before the first update
        return self.geometry.updates_per_epoch * self.job.rl.epochs_per_rollout > 1

    def kl_in_reward(self) -> bool:
        return self.job.rl.kl_placement(self.name) == "reward"

    def frozen_targets(self, rollout: RolloutResult) -> Targets:
        """Rewards, advantages ([N], or [N, R] for the reinforce_pp estimators) and, with the KL as a loss
        term, reference log-probs [N, R], plus the rollout's sequences and behaviour log-probs: everything
        the loss reads, fixed for all replay epochs of the step."""
        self.score(rollout)
        targets = rollout.training_tensors()
        reference = None
        if self.reference is not None:
            reference = self.scoring.frozen_logprobs(self.reference, targets)
            if not self.kl_in_reward():
                targets["reference_logprobs"] = reference
        targets["advantages"] = self.advantages(rollout, targets, reference)
        return Targets(targets)

    def advantages(self, rollout: RolloutResult, targets: dict, reference: torch.Tensor | None) -> torch.Tensor:
        """rl.advantage_estimator's advantages of the rollout's responses (docs/guides/rl.md)."""
        settings, rewards, group_size = self.job.rl, rollout.rewards, rollout.group_size
        mask = targets["response_mask"]
        if settings.advantage_estimator == "grpo":
            return grpo_advantages(rewards, group_size, normalize_std=settings.normalize_advantage_std)
        if settings.advantage_estimator == "rloo":
            return rloo_advantages(rewards, group_size)
        if settings.advantage_estimator == "reinforce_pp_baseline":
            centred = grpo_advantages(rewards, group_size, normalize_std=False)
            return global_standardize(broadcast_sequence_advantages(centred, mask), mask, self.sum_over_ranks)
        # reinforce_pp: -kl_coef * k_t on every token, the score on the last; returns whitened over the step.
        kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if reference is not None:
            kind = settings.kl_kind(self.name)
            kl = kl_estimate(targets["behaviour_logprobs"], reference, kind, max_log_ratio=settings.kl_max_log_ratio)
            kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
            targets["reward_kl"] = kl  # for the `kl` metric
        token_rewards = kl_shaped_rewards(rewards.float(), kl, mask, settings.kl_coef)
        returns = discounted_returns(token_rewards, mask, gamma=settings.gamma)
        return global_standardize(returns, mask, self.sum_over_ranks)

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        """Clipped surrogate (+ kl_coef * KL estimate as a loss term), over response tokens [B, R];
        `normalizer` = the optimizer step's global loss units / (ranks x accumulation), so DeepSpeed's
        averaging yields their mean."""
        settings, mask = self.job.rl, batch["response_mask"]
        options = self.router_options(policy)  # a mixture of experts returns its load-balancing loss
        logprobs, entropy, output = self.scoring.token_statistics(policy, batch, entropy="metric", **options)
        advantages = batch["advantages"]
        if advantages.dim() == 1:
            advantages = broadcast_sequence_advantages(advantages, mask)
        behaviour = batch.get("behaviour_logprobs")  # None: one update per rollout, the weights that sampled
        policy_loss = ppo_policy_loss(
            logprobs,
            logprobs.detach() if behaviour is None else behaviour,
            advantages,
            mask,
            clip_eps=settings.clip_eps_low,
            clip_eps_high=settings.clip_eps_high,
            max_log_ratio=settings.max_log_ratio,
            importance_sampling=settings.importance_sampling,
            **self.aggregation(normalizer),
        )
        loss = policy_loss.loss
        tokens = float(mask.sum())
        sums = {
            "clip_frac": float(policy_loss.clip_fraction) * tokens,
            "log_ratio_clamp_frac": float(policy_loss.log_ratio_clamp_fraction) * tokens,
        }
        if "reference_logprobs" in batch:
            kind = settings.kl_kind(self.name)
            kl = kl_estimate(logprobs, batch["reference_logprobs"], kind, max_log_ratio=settings.kl_max_log_ratio)
            loss = loss + settings.kl_coef * self._aggregate(kl, mask, normalizer)
            sums["kl"] = float(masked_sum(kl.detach(), mask))
        elif "reward_kl" in batch:
            sums["kl"] = float(masked_sum(batch["reward_kl"], mask))
        sums["entropy"] = float(masked_sum(entropy, mask))
        sums["loss"] = self.unit_sum(loss, normalizer)
        loss = loss + self.router_aux_loss(policy, output, self.loss_weight(batch), normalizer, sums, tokens)
        return StepOutput(loss, sums)
