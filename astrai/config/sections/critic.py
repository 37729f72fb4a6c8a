"""The `critic` section: the value model of `online_ppo`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astrai.config.sections.base import Section
from astrai.config.sections.model import LoraSection


class CriticConfig(Section):
    """The value model of `online_ppo`: its own DeepSpeed engine, optimizer, schedule and clipping."""

    path: str | None = Field(
        None,
        description="Start the critic from this folder: a critic export (`export-hf --part critic`) or any "
        "transformers model, whose trunk is used with a zero value head. null: the policy's starting weights "
        "(model.path or model.init with train.seed). Also lets a resume from a checkpoint without critic/ start a new "
        "critic.",
    )
    lr: float | None = Field(None, gt=0, description="Critic peak learning rate (null: train.lr).")
    weight_decay: float | None = Field(None, ge=0, description="Critic AdamW weight decay (null: train.weight_decay).")
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip the critic's gradient norm to this (null: train.max_grad_norm)."
    )
    lr_schedule: Literal["cosine", "linear", "constant"] | None = Field(
        None, description="Critic LR decay after warmup (null: train.lr_schedule)."
    )
    warmup_steps: int | None = Field(
        None,
        ge=0,
        description="Critic linear warmup, in steps (rollouts) as train.warmup_steps (null: the policy's warmup).",
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None, description="ZeRO stage of the critic's engine (null: the policy's)."
    )
    warmup_rollouts: int = Field(
        0,
        ge=0,
        description="Train only the critic on the first N rollouts (the policy is frozen and policy_version stays 0).",
    )
    lora: LoraSection | None = Field(
        None,
        description="A LoRA adapter on the critic's trunk, as model.lora; its value head stays fully trainable. "
        "null: the whole critic trains.",
    )
