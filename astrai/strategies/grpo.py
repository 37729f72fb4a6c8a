"""`grpo`: Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath), token-level and clipped.

For the G responses o_1..o_G to one prompt, with rewards r_i:

    A_i    = (r_i - mean(r)) / (std(r) + 1e-6)          (rl.normalize_advantage_std: false -> r_i - mean(r))
    ratio  = pi(o_i,t) / pi_old(o_i,t)                  (pi_old: the behaviour log-probs, frozen at rollout)
    loss_t = max(-A_i ratio, -A_i clip(ratio, 1 - eps_low, 1 + eps_high)) + kl_coef * k3(pi, pi_ref)_t

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

import torch

from astrai.algos.advantages import grpo_advantages
from astrai.algos.kl import kl_k3
from astrai.algos.masked import masked_sum
from astrai.algos.ppo import broadcast_sequence_advantages, entropy_from_logits, ppo_policy_loss
from astrai.rollout import RolloutResult, response_logprobs
from astrai.rollout.sequences import masked_token_logprobs, response_forward
from astrai.strategies.base import StepOutput, register
from astrai.strategies.online import OnlineStrategy


@register
class GrpoStrategy(OnlineStrategy):
    name = "grpo"

    def setup(self, run) -> None:
        super().setup(run)
        if self.job.rl.kl_coef > 0:
            self.build_reference(run)

    def needs_behaviour_logprobs(self) -> bool:
        return self.geometry.updates_per_epoch * self.job.rl.epochs_per_rollout > 1

    def frozen_targets(self, rollout: RolloutResult) -> dict[str, torch.Tensor]:
        """Rewards, advantages [N] and reference log-probs [N, R], plus the rollout's sequences and
        behaviour log-probs: everything the loss reads, fixed for all replay epochs of the step."""
        self.score(rollout)
        targets = rollout.training_tensors()
        targets["advantages"] = grpo_advantages(rollout.rewards, rollout.group_size, normalize_std=self.job.rl.normalize_advantage_std)
        if self.reference is not None:
            targets["reference_logprobs"] = response_logprobs(
                self.reference, targets, temperature=self.job.rollout.temperature, batch_size=self.geometry.micro_batch_size,
                vocab_size=len(self.tokenizer),
            )
        return targets

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        """Clipped surrogate + kl_coef * k3, over response tokens [B, R]; `normalizer` = the optimizer
        step's global loss units / (ranks x accumulation), so DeepSpeed's averaging yields their mean."""
        settings, mask = self.job.rl, batch["response_mask"]
        options = self.router_options(policy)  # a mixture of experts returns its load-balancing loss
        temperature, vocab_size = self.job.rollout.temperature, len(self.tokenizer)
        logits, output = response_forward(policy, batch, temperature, vocab_size, **options)  # [B, R, vocab]
        logprobs = masked_token_logprobs(logits, batch["response_ids"], mask)
        token_advantages = broadcast_sequence_advantages(batch["advantages"], mask)
        token_mean = settings.loss_aggregation == "token_mean"
        behaviour = batch.get("behaviour_logprobs")  # None: one update per rollout, the weights that sampled
        policy_loss = ppo_policy_loss(
            logprobs, logprobs.detach() if behaviour is None else behaviour, token_advantages, mask, clip_eps=settings.clip_eps_low, clip_eps_high=settings.clip_eps_high,
            aggregation="global" if token_mean else "sequence_mean", global_token_count=normalizer if token_mean else None,
        )
        loss = policy_loss.loss if token_mean else policy_loss.loss * mask.shape[0] / normalizer
        tokens = float(mask.sum())
        sums = {"clip_frac": float(policy_loss.clip_fraction) * tokens}
        if self.reference is not None:
            kl = kl_k3(logprobs, batch["reference_logprobs"], max_log_ratio=settings.kl_max_log_ratio)
            loss = loss + settings.kl_coef * self._aggregate(kl, mask, normalizer)
            sums["kl"] = float(masked_sum(kl.detach(), mask))
        with torch.no_grad():
            sums["entropy"] = float(masked_sum(entropy_from_logits(logits.detach()), mask))
        sums["loss"] = float(loss.detach()) * normalizer  # the sum of this micro-batch's unit losses
        loss = loss + self.router_aux_loss(policy, output, self.loss_weight(batch), normalizer, sums, tokens)
        return StepOutput(loss, sums)
