"""The `rl` section: policy optimisation of the online train types (replay, clipping, KL, advantages)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from astrai.config.sections.base import Section
from astrai.train_types import train_type_rules


class OverlongPenalty(Section):
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13), added to every response's reward."""

    buffer_tokens: int = Field(
        ..., ge=1, description="L_cache: the penalty grows linearly over the buffer_tokens tokens before max_tokens."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="L_max: a response this long or longer gets -penalty_factor; 0 up to max_tokens - "
        "buffer_tokens (null: rollout.max_new_tokens, so a truncated response gets the full penalty).",
    )
    penalty_factor: float = Field(
        1.0,
        gt=0,
        description="Scale of the penalty, in reward units (verl's overlong_buffer.penalty_factor; the "
        "paper's is 1, against a correctness reward of +-1).",
    )

    @model_validator(mode="after")
    def _buffer_within(self) -> OverlongPenalty:
        if self.max_tokens is not None and self.buffer_tokens > self.max_tokens:
            raise ValueError(
                f"`rl.overlong_penalty.buffer_tokens` ({self.buffer_tokens}) is larger than "
                f"`rl.overlong_penalty.max_tokens` ({self.max_tokens})"
            )
        return self


class RlConfig(Section):
    packing: bool = Field(
        False,
        description="Padding-free forwards of the policy, reference and critic (grpo, online_ppo): each "
        "micro-batch's sequences run as one packed row without their padding, micro-batches cut by "
        "`train.micro_batch_tokens` instead of `train.micro_batch_size`; the losses are unchanged.",
    )
    share_prefix: bool = Field(
        False,
        description="The policy's, the reference's and the critic's forwards (grpo, online_ppo) run each distinct "
        "prompt of a micro-batch once and its responses against its keys and values, with the gradient summed "
        "over them as before (astrai/rollout/prefix_scoring.py): the same losses within float rounding, less "
        "compute when group_size responses share a long prompt. The replay shuffles whole groups, so a "
        "micro-batch of group_size x k sequences holds k prompts. Needs rollout.group_size >= 2; not with "
        "`rl.packing` or `model.gradient_checkpointing`.",
    )
    epochs_per_rollout: int = Field(
        1,
        ge=1,
        description="Passes over each rollout; targets (rewards, advantages, returns, behaviour and reference "
        "log-probs) stay fixed across them.",
    )
    minibatch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step across all ranks; must equal train.micro_batch_size x "
        "train.grad_accum_steps x ranks (null: that product).",
    )
    clip_eps: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Symmetric PPO clip: sets clip_eps_low, and clip_eps_high unless given (null: use "
        "clip_eps_low/high).",
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="PPO clip: the ratio's lower bound is 1 - clip_eps_low.")
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="The ratio's upper bound is 1 + clip_eps_high (DAPO's clip-higher uses 0.28; null: clip_eps_low).",
    )
    dual_clip_c: float | None = Field(
        None,
        gt=1,
        description="`online_ppo`: dual-clip (Ye et al. 2020) caps a negative-advantage token's loss at -A x c (e.g. "
        "3; null: off).",
    )
    kl_coef: float = Field(
        0.04,
        ge=0,
        description="Weight of the KL to the reference: in the loss for `grpo` (GRPO paper: 0.04; in the reward with "
        "rl.advantage_estimator reinforce_pp), in the per-token reward for `online_ppo` (see rl.kl_in_reward); the "
        "starting value when rl.target_kl is set. 0 (without target_kl) skips the reference model entirely.",
    )
    kl_max_log_ratio: float | None = Field(
        10.0,
        gt=0,
        description="Clamp |log pi - log pi_ref| here before k3 (whose exp overflows past ~88); null: no clamp.",
    )
    normalize_advantage_std: bool = Field(
        True,
        description="`grpo`: advantages (r - group mean) / (group std + 1e-6) as in GRPO; false: r - group mean only "
        "(Dr. GRPO). Read by rl.advantage_estimator grpo only.",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean",
        description="`token_mean`: every response token of the optimizer step weighs the same; `sequence_mean`: every "
        "response does (GRPO paper).",
    )
    gamma: float = Field(
        1.0, ge=0, le=1, description="`online_ppo`: GAE discount per response token (1: no discount within a response)."
    )
    gae_lambda: float = Field(
        0.95, ge=0, le=1, description="`online_ppo`: GAE lambda (1: Monte Carlo returns, 0: one-step TD)."
    )
    vf_coef: float = Field(
        1.0,
        gt=0,
        description="`online_ppo`: multiplier of the critic's loss. The critic has its own optimizer, so this trades "
        "off nothing against the policy loss: with AdamW it mostly moves where critic.max_grad_norm starts clipping "
        "(docs/guides/ppo.md).",
    )
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="`online_ppo`: PPO2 value clipping, |V - V_old| <= value_clip in the clipped branch (null: plain "
        "squared error).",
    )
    whiten_advantages: bool = Field(
        True, description="`online_ppo`: whiten the GAE advantages over the valid tokens of the whole step (all ranks)."
    )
    kl_in_reward: bool = Field(
        True,
        description="`online_ppo`: -kl_coef x KL(behaviour, reference) in every token's reward (Ziegler et al.); "
        "false: kl_coef x k3 in the loss, as `grpo`.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None,
        description="Per-token KL estimator (Schulman's k1, k2, k3). null: k1 where the KL is in the reward "
        "(`online_ppo` with rl.kl_in_reward, `reinforce_pp`), k3 where it is a loss term (`grpo`, rl.kl_in_reward: "
        'false). k1 as a loss term has zero expected gradient and is refused (docs/guides/rl.md, "Which KL '
        'estimator where").',
    )
    target_kl: float | None = Field(
        None,
        gt=0,
        description="`online_ppo`: adaptive KL coefficient (Ziegler et al. 2019) steering the KL, in nats per "
        "response, to this value (null: fixed kl_coef).",
    )
    kl_horizon: float = Field(
        10000.0, gt=0, description="`online_ppo`: horizon of the adaptive KL controller, in responses."
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="`online_ppo`: clip each sequence reward to [-reward_clip, reward_clip] before shaping (null: "
        "off).",
    )
    reward_normalization: Literal["none", "batch"] = Field(
        "none",
        description="`online_ppo`: `batch` standardises the sequence rewards over all responses of the step (all "
        "ranks) before shaping.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="`online_ppo`: entropy bonus, minus entropy_coef x the token-mean entropy in the policy loss.",
    )
    max_log_ratio: float = Field(
        20.0,
        gt=0,
        description="Clamp log(pi / pi_old) to [-max_log_ratio, max_log_ratio] before exp in the policy "
        "loss (past ~88 the float32 ratio is inf and the gradient NaN); clamped tokens get no gradient and are "
        "counted in the `log_ratio_clamp_frac` metric.",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp"] = Field(
        "grpo",
        description="`grpo` train type: `grpo` (group mean and std), `rloo` (leave-one-out group mean), "
        "`reinforce_pp_baseline` (group mean removed, then whitened over the step's tokens), `reinforce_pp` (k1 KL in "
        "every token's reward, returns whitened over the step's tokens, no group baseline).",
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token",
        description="Policy-loss ratio: `token` (PPO, one per token) or `sequence` (GSPO: exp of the "
        "sequence's mean log-ratio, clipped per sequence; GSPO's paper pairs it with loss_aggregation sequence_mean "
        "and clip ranges of ~3e-4 / 4e-4).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="`grpo`: DAPO's dynamic sampling: drop groups whose rewards are all equal (advantages 0) "
        "and sample more prompts until the step holds rollout.prompts_per_step informative groups (metrics "
        "sampling_rounds, kept_groups, dropped_groups; docs/guides/rl.md).",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="`rl.dynamic_sampling`: at most this many rounds of rollout.prompts_per_step prompts per "
        "step; short of informative groups after them, the step is filled with groups of equal rewards (advantages 0).",
    )
    overlong_penalty: OverlongPenalty | None = Field(
        None,
        description="DAPO's soft length penalty added to each reward: {buffer_tokens, max_tokens, "
        "penalty_factor} (null: off; metric overlong_penalty).",
    )
    mask_truncated: bool = Field(
        False,
        description="Responses cut at rollout.max_new_tokens (no EOS) take no loss (DAPO's overlong "
        "filtering); their rewards still count in their group's baseline.",
    )

    def kl_placement(self, train_type: str) -> str:
        """Where the KL to the reference goes for this train type: "reward" or "loss"."""
        return train_type_rules(train_type).kl_placement(self)

    def kl_kind(self, train_type: str) -> str:
        """rl.kl_estimator, or its default where it is null: k1 in the reward, k3 as a loss term."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k1" if self.kl_placement(train_type) == "reward" else "k3"

    @model_validator(mode="after")
    def _clip_alias(self) -> RlConfig:
        if self.clip_eps is not None:
            if "clip_eps_low" in self.model_fields_set and self.clip_eps_low != self.clip_eps:
                raise ValueError(
                    f"give `rl.clip_eps` ({self.clip_eps}) or `rl.clip_eps_low` ({self.clip_eps_low}), not both"
                )
            self.clip_eps_low = self.clip_eps
            if self.clip_eps_high is None:
                self.clip_eps_high = self.clip_eps
        if self.target_kl is not None and self.kl_coef == 0:
            raise ValueError("`rl.target_kl` adapts rl.kl_coef multiplicatively: give a starting `rl.kl_coef` > 0")
        return self
