"""`online_ppo`: PPO for language models with a separately optimised critic (Ziegler et al. 2019,
Ouyang et al. 2022; the implementation details of Huang et al. 2024, "The N+ Implementation Details of
RLHF with PPO").

One step (`trainer.train_online` drives it):

    rollout            group_size responses per prompt; behaviour log-probs logp_old [N, R]
    frozen targets     no gradient: reference log-probs, critic values V [N, R], sequence rewards s [N]
      rewards          r_t = -kl_coef * k1(logp_old, logp_ref)_t on every response token, + s on the last real one
      GAE              delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lambda A_{t+1},  R_t = A_t + V_t
      pinned           values, advantages, returns are set on the RolloutResult, never recomputed in replay
    replay             epochs_per_rollout x minibatches; per micro-batch a policy step and a critic step:
      policy           max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)) [dual-clip] - entropy_coef H
      critic           vf_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2)

Choices and departures:
- The critic is its own engine (own optimizer, schedule, clipping, ZeRO stage), not a head on the policy:
  `vf_coef` therefore trades off nothing against the policy loss; it scales the critic's gradient, which
  AdamW normalises away except where `critic.max_grad_norm` clips (docs/guides/rl.md).
- Advantages are whitened over every valid token of the step on all ranks (one all-reduce), so the
  update does not depend on how many ranks share the rollout. Returns use the raw advantages.
- V_t is read where response token t is predicted (the state before it), as the logits are.
- Sequence rewards may be clipped, then standardised over the step (`rl.reward_clip`,
  `rl.reward_normalization`) before shaping; `reward_mean` logs them raw.
- The adaptive KL coefficient (`rl.target_kl`) is updated once per rollout, after shaping it, with the
  step's mean KL per response (nats, summed over tokens) over the step's responses (Ziegler et al. eq. 2.2).
- `rl.kl_in_reward: false` moves the KL from the reward into the policy loss (kl_coef * k3(pi, pi_ref), as grpo).
- The KL estimator defaults by placement (rl.kl_estimator null): k1 in the reward, whose score-function
  gradient is exactly grad KL(pi || ref); k3 as a loss term, whose pathwise gradient is grad KL(ref || pi).
  k3 in the reward would give grad [KL(pi || ref) - KL(ref || pi)], which nearly cancels (algos/kl.py).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from astrai.algos.advantages import AdaptiveKLController, FixedKLController, compute_gae, kl_shaped_rewards
from astrai.algos.kl import kl_estimate
from astrai.algos.masked import WHITEN_EPS, masked_sum
from astrai.algos.ppo import ppo_policy_loss, value_loss
from astrai.engine import all_reduce_sums
from astrai.rollout import RolloutResult, frozen_response_values, response_logprobs, response_values
from astrai.rollout.sequences import response_token_statistics
from astrai.strategies.base import StepOutput, register
from astrai.strategies.online import OnlineStrategy

logger = logging.getLogger("astrai.ppo")


def global_standardize(values: torch.Tensor, mask: torch.Tensor, device) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the mean and unbiased variance of the valid entries of
    every rank; 0 at padding. values, mask: any one shape ([N, R] tokens or [N] responses). On one rank
    this is `masked.masked_whiten`."""
    valid = mask.bool()
    selected = values[valid].double()
    count, total, squares = all_reduce_sums(
        [float(valid.sum()), float(selected.sum()), float((selected**2).sum())], device
    )
    mean = total / max(count, 1.0)
    variance = max(squares - count * mean**2, 0.0) / max(count - 1.0, 1.0)
    standardized = (values - mean) / math.sqrt(variance + WHITEN_EPS)
    return torch.where(valid, standardized, torch.zeros_like(standardized))


@register
class PPOStrategy(OnlineStrategy):
    name = "online_ppo"
    engine_parts = ("policy", "critic")
    required_parts = ("policy", "critic")

    def setup(self, run) -> None:
        super().setup(run)
        settings = self.job.rl
        self.critic = run.engines["critic"]
        self.critic_source = self.job.critic.path or "the policy's starting weights"
        if settings.target_kl is not None:
            self.kl_controller = AdaptiveKLController(settings.kl_coef, settings.target_kl, settings.kl_horizon)
        else:
            self.kl_controller = FixedKLController(settings.kl_coef)
        self.loss_kl_coef = settings.kl_coef  # the coefficient of the step being replayed (kl_in_reward: false)
        if settings.kl_coef > 0:
            self.build_reference(run)

    def parts_to_resume(self, checkpoint: Path) -> tuple[str, ...]:
        """Policy and critic; only the policy when `critic.path` is set and `checkpoint` has no critic
        (the critic then starts from critic.path). Without critic.path a missing critic fails the resume."""
        if self.job.critic.path is None or (checkpoint / "critic").is_dir():
            return self.required_parts
        logger.warning(
            "%s has no critic part: starting a new critic from critic.path %s", checkpoint, self.job.critic.path
        )
        return ("policy",)

    def trains_policy(self, step: int) -> bool:
        return step > self.job.critic.warmup_rollouts

    def checkpoint_meta(self) -> dict:
        return {**super().checkpoint_meta(), "critic": self.critic_source}

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])

    # ----------------------------------------------------------------------------- frozen targets

    def frozen_targets(self, rollout: RolloutResult) -> dict[str, torch.Tensor]:
        """Everything the losses read, computed once per rollout and pinned on it: values, advantages,
        returns [N, R] (plus the sequences, behaviour and, with the KL in the loss, reference log-probs)."""
        settings = self.job.rl
        self.score(rollout)
        targets = rollout.training_tensors()
        mask = targets["response_mask"]
        values = frozen_response_values(self.critic, targets, batch_size=self.geometry.micro_batch_size)
        kl = self.reference_kl(targets)
        coefficient = self.kl_controller.value
        shaping = coefficient if settings.kl_in_reward else 0.0
        rewards = kl_shaped_rewards(self.sequence_scores(rollout.rewards), kl, mask, shaping)
        advantages, returns = compute_gae(rewards, values, mask, settings.gamma, settings.gae_lambda)
        if settings.whiten_advantages:
            advantages = global_standardize(advantages, mask, self.dist.device)
        rollout.values, rollout.advantages, rollout.returns = values, advantages, returns
        if self.reference is not None:
            rollout.kl_coef = coefficient
            rollout.kl = kl if settings.kl_in_reward else None  # in the loss, the `kl` metric comes from the loss
        self.loss_kl_coef = coefficient
        self.update_kl_coefficient(kl, mask)
        targets.update(values=values, advantages=advantages, returns=returns)
        return targets

    def reference_kl(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token KL estimate (rl.kl_estimator) of the behaviour policy against the reference [N, R], 0 on
        padding, all 0 without a reference. With the KL in the loss, adds targets["reference_logprobs"]."""
        mask = targets["response_mask"].bool()
        if self.reference is None:
            return torch.zeros_like(targets["behaviour_logprobs"])
        settings = self.job.rl
        reference = response_logprobs(
            self.reference,
            targets,
            temperature=self.job.rollout.temperature,
            batch_size=self.geometry.micro_batch_size,
            vocab_size=len(self.tokenizer),
            chunk_size=self.job.train.logits_chunk_size,
        )
        if not settings.kl_in_reward:
            targets["reference_logprobs"] = reference
        kind = settings.kl_kind(self.name)
        kl = kl_estimate(targets["behaviour_logprobs"], reference, kind, max_log_ratio=settings.kl_max_log_ratio)
        return torch.where(mask, kl, torch.zeros_like(kl))

    def sequence_scores(self, rewards: torch.Tensor) -> torch.Tensor:
        """The rollout's rewards [N] as shaped into the last token: clipped, then standardised over the step."""
        scores = rewards.float()
        if self.job.rl.reward_clip is not None:
            scores = scores.clamp(-self.job.rl.reward_clip, self.job.rl.reward_clip)
        if self.job.rl.reward_normalization == "batch":
            scores = global_standardize(scores, torch.ones_like(scores, dtype=torch.bool), self.dist.device)
        return scores

    def update_kl_coefficient(self, kl: torch.Tensor, mask: torch.Tensor) -> None:
        """Adaptive KL: the step's KL per response (summed over its tokens), averaged over every rank's responses."""
        if self.reference is None or self.job.rl.target_kl is None:
            return
        kl_sum, responses = all_reduce_sums(
            [float(masked_sum(kl.double(), mask)), float(mask.shape[0])], self.dist.device
        )
        self.kl_controller.update(kl_sum / max(responses, 1.0), int(responses))

    # ----------------------------------------------------------------------------- losses

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        """Clipped surrogate on the pinned advantages [B, R] (- entropy bonus, + KL if not in the reward);
        `normalizer` = the optimizer step's global loss units / (ranks x accumulation), as in grpo."""
        settings, mask = self.job.rl, batch["response_mask"]
        options = self.router_options(policy)  # a mixture of experts returns its load-balancing loss
        temperature, vocab_size = self.job.rollout.temperature, len(self.tokenizer)
        logprobs, entropy, output = response_token_statistics(
            policy,
            batch,
            temperature=temperature,
            vocab_size=vocab_size,
            chunk_size=self.job.train.logits_chunk_size,
            entropy="trained" if settings.entropy_coef > 0 else "metric",
            **options,
        )
        surrogate = ppo_policy_loss(
            logprobs,
            batch["behaviour_logprobs"],
            batch["advantages"],
            mask,
            clip_eps=settings.clip_eps_low,
            clip_eps_high=settings.clip_eps_high,
            dual_clip=settings.dual_clip_c,
            max_log_ratio=settings.max_log_ratio,
            importance_sampling=settings.importance_sampling,
            **self.aggregation(normalizer),
        )
        policy_loss = surrogate.loss
        loss = policy_loss
        if settings.entropy_coef > 0:
            loss = loss - settings.entropy_coef * self._aggregate(entropy, mask, normalizer)
        tokens = float(mask.sum())
        sums = {
            "policy_loss": float(policy_loss.detach()) * normalizer,
            "clip_frac": float(surrogate.clip_fraction) * tokens,
            "approx_kl": float(surrogate.approx_kl) * tokens,
            "entropy": float(masked_sum(entropy.detach(), mask)),
            "log_ratio_clamp_frac": float(surrogate.log_ratio_clamp_fraction) * tokens,
        }
        if "reference_logprobs" in batch:
            kind = settings.kl_kind(self.name)
            kl = kl_estimate(logprobs, batch["reference_logprobs"], kind, max_log_ratio=settings.kl_max_log_ratio)
            loss = loss + self.loss_kl_coef * self._aggregate(kl, mask, normalizer)
            sums["kl"] = float(masked_sum(kl.detach(), mask))
        sums["loss"] = float(loss.detach()) * normalizer
        loss = loss + self.router_aux_loss(policy, output, self.loss_weight(batch), normalizer, sums, tokens)
        return StepOutput(loss, sums)

    def compute_critic_loss(self, critic, batch: dict, normalizer: float) -> StepOutput:
        """vf_coef x the clipped value loss of the critic's values [B, R] against the pinned returns.
        Logged `value_loss` is before vf_coef (the regression error itself)."""
        settings, mask = self.job.rl, batch["response_mask"]
        values = response_values(critic, batch)
        regression = value_loss(
            values,
            batch["values"],
            batch["returns"],
            mask,
            clip_range=settings.value_clip,
            **self.aggregation(normalizer),
        )
        loss = regression.loss
        sums = {
            "value_loss": float(loss.detach()) * normalizer,
            "value_clip_frac": float(regression.clip_fraction) * float(mask.sum()),
        }
        return StepOutput(settings.vf_coef * loss, sums)
