"""The `rm` section: reward-model training (`train_type: rm`)."""

from __future__ import annotations

from pydantic import Field

from astrai.config.sections.base import Section


class RmConfig(Section):
    margin_field: str | None = Field(
        None,
        description="`rm`: data field holding each pair's margin m, subtracted inside the loss "
        "-log sigmoid(r_c - r_r - m) (Llama 2's reward model; a larger m for a clearer preference). null: no margin.",
    )
    center_rewards_coef: float = Field(
        0.0,
        ge=0,
        description="`rm`: weight of the centring term coef x mean((r_c + r_r)^2), which keeps the rewards near mean 0 "
        "(TRL's `center_rewards_coefficient`, suggested 0.01; 0: off).",
    )
    share_prefix: bool = Field(
        False,
        description="`rm`: each micro-batch runs every distinct prompt once and the chosen and rejected completions "
        "against its keys and values (astrai/rollout/prefix_scoring.py), instead of the prompt once per completion: "
        "the same rewards and gradients within float rounding, fewer tokens when completions are short beside "
        "their prompts. Not with `model.gradient_checkpointing`.",
    )
