"""A train type is a small strategy class registered by name; the loops call it, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch


@dataclass
class StepOutput:
    """What one micro-batch contributes: the loss to backpropagate and detached metric sums."""

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)  # summed over micro-batches and ranks, then divided by `sums["weight"]`


class Strategy:
    name: ClassVar[str]
    loop: ClassVar[str]  # "offline" or "online"
    required_parts: ClassVar[tuple[str, ...]] = ("policy",)  # what a checkpoint must hold to resume this train type
    engine_parts: ClassVar[tuple[str, ...]] = ("policy",)  # the trainable engines build_run makes (online_ppo adds "critic")
    renders_chats: ClassVar[bool] = True  # rows go through the tokenizer's chat template (not seq's plain text)

    def __init__(self, job, tokenizer):
        self.job = job
        self.tokenizer = tokenizer

    # The interface the loops call, in the order they call it.
    def prepare_data(self, rows):
        """Raw rows -> (tokenised datasets.Dataset, number of malformed rows skipped)."""
        raise NotImplementedError

    def parts_to_resume(self, checkpoint: Path) -> tuple[str, ...]:
        """The engine parts a resume from `checkpoint` must load; a missing one fails the resume, named."""
        return self.required_parts

    @classmethod
    def check_job(cls, job, world_size: int) -> None:
        """Raise ConfigError for what only this train type rejects, given the world size (before any rank works)."""

    def optimizer_steps_per_step(self, world_size: int) -> int:
        """Optimizer updates in one trainer step; the LR schedule spans max_steps x this many."""
        return 1

    def setup(self, run) -> None:
        """Build what the strategy holds besides the trainable engines (e.g. a frozen reference)."""

    def checkpoint_meta(self) -> dict:
        """Facts a checkpoint of this train type records in its manifest (e.g. the reference used)."""
        return {}

    def state_dict(self) -> dict:
        """What the strategy itself must carry across a resume (e.g. an adaptive KL coefficient); JSON-able."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s mapping ({} for a checkpoint that has none)."""

    def collate(self, rows: list[dict]) -> dict:
        raise NotImplementedError

    def loss_weight(self, batch: dict) -> int:
        """How many units (tokens, pairs) the micro-batch's loss sums over; the step divides by the global total."""
        raise NotImplementedError

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        raise NotImplementedError


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    REGISTRY[cls.name] = cls
    return cls


def strategy_class(train_type: str) -> type[Strategy]:
    import astrai.strategies  # noqa: F401  (registers every built-in train type)

    if train_type not in REGISTRY:
        raise KeyError(f"train.train_type: {train_type!r} is not available in this version (available: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[train_type]
