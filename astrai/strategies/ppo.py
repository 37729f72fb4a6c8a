"""`online_ppo`: PPO for language models with a separately optimised critic (Ziegler et al. 2019,
Ouyang et al. 2022; the implementation details of Huang et al. 2024, "The N+ Implementation Details of
RLHF with PPO").

One step (`trainer.train_online` drives it):

    rollout            group_size responses per prompt; behaviour log-probs logp_old [N, R]
    frozen targets     no gradient: reference log-probs, critic values V [N, R], sequence rewards s [N]
      rewards          r_t = -kl_coef * k1(logp_old, logp_ref)_t on every response token, + s on the last real one
      GAE              delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lambda A_{t+1},  R_t = A_t + V_t
      pinned           values, advantages, returns are held by PPOTargets, never recomputed in replay
    replay             epochs_per_rollout x minibatches; per micro-batch a policy step and a critic step:
      policy           max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)) [dual-clip] - entropy_coef H
      critic           vf_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2)

Choices and departures:
- The critic is its own engine (own optimizer, schedule, clipping, ZeRO stage), not a head on the policy:
  `vf_coef` therefore trades off nothing against the policy loss; it scales the critic's gradient, which
  AdamW normalises away except where `critic.max_grad_norm` clips (docs/guides/ppo.md).
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astrai.algos.advantages import AdaptiveKLController, FixedKLController, compute_gae, kl_shaped_rewards
from astrai.algos.kl import kl_estimate
from astrai.algos.masked import global_standardize, masked_sum
from astrai.algos.ppo import ppo_policy_loss, value_loss
from astrai.rollout import RolloutResult
from astrai.strategies.base import StepOutput, register
from astrai.strategies.online_base import OnlineStrategy
from astrai.strategies.targets import Targets
from astrai.train_types import OnlinePpoRules

if TYPE_CHECKING:  # Run holds the strategy: named for annotations only, the strategies never import training/
    from astrai.training.run_parts import Run

logger = logging.getLogger("astrai.ppo")


@dataclass
class PPOTargets(Targets):
    """online_ppo's frozen targets: values, advantages, returns [N, R] among the tensors (with the sequences,
    behaviour and, with the KL in the loss, reference log-probs), and the KL the rewards were shaped with."""

    token_mask: torch.Tensor  # [N, R] every response token, rl.mask_truncated's rows too: what the metrics average
    kl: torch.Tensor | None = None  # [N, R] the per-token KL shaped into the rewards (None: in the loss)
    kl_coef: float | None = None  # the coefficient the rewards were shaped with (None without a reference)

    def metric_sums(self) -> dict[str, float]:
        """Sums over the response tokens of values V, returns R and raw advantages R - V (so that the step's
        explained variance 1 - Var[R - V] / Var[R] is over every token of every rank), kl and kl_coef."""
        valid = self.token_mask.bool()
        values, returns = self["values"][valid].double(), self["returns"][valid].double()
        raw_advantages = returns - values
        sums = {
            "targets/responses": float(self.token_mask.shape[0]),
            "targets/tokens": float(valid.sum()),
            "targets/values": float(values.sum()),
            "targets/returns": float(returns.sum()),
            "targets/returns_squared": float((returns**2).sum()),
            "targets/advantages": float(raw_advantages.sum()),
            "targets/advantages_squared": float((raw_advantages**2).sum()),
        }
        if self.kl is not None:
            sums["targets/kl"] = float(self.kl[valid].double().sum())
        if self.kl_coef is not None:  # a mean over responses gives the coefficient back
            sums["targets/kl_coef"] = self.kl_coef * self.token_mask.shape[0]
        return sums


@register
class PPOStrategy(OnlineStrategy):
    name = "online_ppo"
    rules = OnlinePpoRules
    engine_parts = ("policy", "critic")
    required_parts = ("policy", "critic")

    def setup(self, run: Run) -> None:
        super().setup(run)
        settings = self.job.rl
        self.critic = run.engines["critic"]
        self.critic_source = self.job.critic.path or "the policy's starting weights"
        if settings.target_kl is not None:
            self.kl_controller = AdaptiveKLController(settings.kl_coef, settings.target_kl, settings.kl_horizon)
        else:
            self.kl_controller = FixedKLController(settings.kl_coef)
        self.loss_kl_coef = settings.kl_coef  # the coefficient of the step being replayed (kl_in_reward: false)
        if self.needs_reference(self.job):
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

    def trains_part(self, part: str, step: int) -> bool:
        return part != "policy" or step > self.job.critic.warmup_rollouts

    def part_loss(self, part: str, engine, batch: dict, normalizer: float) -> StepOutput:
        if part == "critic":
            return self.compute_critic_loss(engine, batch, normalizer)
        return super().part_loss(part, engine, batch, normalizer)

    def checkpoint_meta(self) -> dict:
        return {**super().checkpoint_meta(), "critic": self.critic_source}

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])

    # ----------------------------------------------------------------------------- frozen targets

    def frozen_targets(self, rollout: RolloutResult) -> PPOTargets:
        """Everything the losses read, computed once per rollout and fixed for its replay: values, advantages,
        returns [N, R] (plus the sequences, behaviour and, with the KL in the loss, reference log-probs)."""
        settings = self.job.rl
        self.score(rollout)
        targets = rollout.training_tensors()
        mask = targets["response_mask"]
        values = self.scoring.frozen_values(self.critic, targets)
        kl = self.reference_kl(targets)
        coefficient = self.kl_controller.value
        shaping = coefficient if settings.kl_in_reward else 0.0
        rewards = kl_shaped_rewards(self.sequence_scores(rollout.rewards), kl, mask, shaping)
        advantages, returns = compute_gae(rewards, values, mask, settings.gamma, settings.gae_lambda)
        if settings.whiten_advantages:
            advantages = global_standardize(advantages, mask, self.sum_over_ranks)
        self.loss_kl_coef = coefficient
        self.update_kl_coefficient(kl, mask)
        targets.update(values=values, advantages=advantages, returns=returns)
        pinned = PPOTargets(targets, token_mask=rollout.response_mask)
        if self.reference is not None:
            pinned.kl_coef = coefficient
            pinned.kl = kl if settings.kl_in_reward else None  # in the loss, the `kl` metric comes from the loss
        return pinned

    def reference_kl(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token KL estimate (rl.kl_estimator) of the behaviour policy against the reference [N, R], 0 on
        padding, all 0 without a reference. With the KL in the loss, adds targets["reference_logprobs"]."""
        mask = targets["response_mask"].bool()
        if self.reference is None:
            return torch.zeros_like(targets["behaviour_logprobs"])
        settings = self.job.rl
        reference = self.scoring.frozen_logprobs(self.reference, targets)
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
            scores = global_standardize(scores, torch.ones_like(scores, dtype=torch.bool), self.sum_over_ranks)
        return scores

    def update_kl_coefficient(self, kl: torch.Tensor, mask: torch.Tensor) -> None:
        """Adaptive KL: the step's KL per response (summed over its tokens), averaged over every rank's responses."""
        if self.reference is None or self.job.rl.target_kl is None:
            return
        kl_sum, responses = self.sum_over_ranks([float(masked_sum(kl.double(), mask)), float(mask.shape[0])])
        self.kl_controller.update(kl_sum / max(responses, 1.0), int(responses))

    # ----------------------------------------------------------------------------- losses

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        """Clipped surrogate on the pinned advantages [B, R] (- entropy bonus, + KL if not in the reward);
        `normalizer` = the optimizer step's global loss units / (ranks x accumulation), as in grpo."""
        settings, mask = self.job.rl, batch["response_mask"]
        options = self.router_options(policy)  # a mixture of experts returns its load-balancing loss
        entropy_use = "trained" if settings.entropy_coef > 0 else "metric"
        logprobs, entropy, output = self.scoring.token_statistics(policy, batch, entropy=entropy_use, **options)
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
            "policy_loss": self.unit_sum(policy_loss, normalizer),
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
        sums["loss"] = self.unit_sum(loss, normalizer)
        loss = loss + self.router_aux_loss(policy, output, self.loss_weight(batch), normalizer, sums, tokens)
        return StepOutput(loss, sums)

    def compute_critic_loss(self, critic, batch: dict, normalizer: float) -> StepOutput:
        """vf_coef x the clipped value loss of the critic's values [B, R] against the pinned returns.
        Logged `value_loss` is before vf_coef (the regression error itself)."""
        settings, mask = self.job.rl, batch["response_mask"]
        values = self.scoring.values(critic, batch)
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
            "value_loss": self.unit_sum(loss, normalizer),
            "value_clip_frac": float(regression.clip_fraction) * float(mask.sum()),
        }
        return StepOutput(settings.vf_coef * loss, sums)
