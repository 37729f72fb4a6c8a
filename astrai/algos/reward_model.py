"""The reward model's pairwise loss: Bradley-Terry (Ouyang et al. 2022, eq. 1), as `rm` trains it.

With r_c, r_r the scalar rewards of the chosen and rejected completion of one prompt,

    loss = -logsigmoid(r_c - r_r - m) + coef * (r_c + r_r)^2

    m     the pair's margin (Llama 2, Touvron et al. 2023, eq. 2: a larger m for a clearer preference;
          0 without `rm.margin_field`)
    coef  `rm.center_rewards_coef`: the auxiliary term of Eisenstein et al. 2023 that pulls the rewards
          towards mean 0, so that they need no offset before use (TRL RewardTrainer's
          `center_rewards_coefficient`; 0 switches it off)

Per pair; the caller sums the pairs and divides by the step's pair count, so the step's loss is the
mean over its pairs of both terms, as TRL's `mean(-logsigmoid(...)) + coef * mean((r_c + r_r)^2)`.
Accuracy counts r_c > r_r strictly: a tie (e.g. a zero-initialised head) is no success.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class RewardModelLoss(NamedTuple):
    """losses is differentiable; the other fields are detached (for metrics)."""

    losses: torch.Tensor  # [batch] per-pair loss (both terms)
    accuracy: torch.Tensor  # [batch] 1.0 where r_c > r_r, else 0.0
    margins: torch.Tensor  # [batch] r_c - r_r (the margin m not subtracted: what the model separates by)


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> RewardModelLoss:
    """chosen, rejected: rewards [batch]; margin: [batch] or None (0). See the module docstring."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected rewards must have one shape [batch], got {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}"
        )
    if margin is not None and margin.shape != chosen.shape:
        raise ValueError(f"margin must have the rewards' shape {tuple(chosen.shape)}, got {tuple(margin.shape)}")
    if center_coef < 0:
        raise ValueError(f"center_coef must be >= 0, got {center_coef}")
    difference = chosen - rejected
    losses = -F.logsigmoid(difference - (margin if margin is not None else 0.0))
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return RewardModelLoss(losses, (difference > 0).float().detach(), difference.detach())
