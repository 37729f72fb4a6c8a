"""Reference-free preference losses: SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024).

Both score a completion by its *average* token log-prob under the policy alone (no reference model):
with a_c, a_r the average log-probs of the chosen and rejected completions of one prompt,

    "simpo": -logsigmoid(beta * (a_c - a_r) - gamma)          (SimPO eq. 6; gamma: target reward margin)
    "orpo":  -a_c - beta * logsigmoid(log_odds)                (ORPO eq. 6-7; beta is the paper's lambda)
             log_odds = log(odds(c) / odds(r)),  odds(y) = P(y) / (1 - P(y)),  P(y) = exp(a_y)
             i.e. log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))

Implicit rewards (metrics only, as TRL's CPOTrainer / ORPOTrainer log them): beta * a_c and beta * a_r.

Departures / choices:
- gamma is the paper's absolute margin (TRL's `simpo_gamma`), not the SimPO repo's gamma/beta ratio:
  the loss sees beta * (a_c - a_r) - gamma, so changing beta does not rescale the margin.
- ORPO's NLL term is the paper's per-sequence mean token NLL of the chosen completion, averaged over
  pairs (= -a_c); TRL instead averages the NLL over all chosen tokens of the batch (longer completions
  weigh more there).
- log(1 - exp(a)) is computed as log(-expm1(a)) near 0 and log1p(-exp(a)) below -log 2 (both exact,
  each stable in its range); a_c = 0 exactly (probability 1) would still give -inf.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

REFERENCE_FREE_LOSSES = ("simpo", "orpo")


class PreferenceOutput(NamedTuple):
    """loss is differentiable; every other field is detached (for metrics only)."""

    loss: torch.Tensor  # scalar: mean of losses over the batch
    losses: torch.Tensor  # [batch] per-pair loss
    rewards_chosen: torch.Tensor  # [batch] beta * a_c
    rewards_rejected: torch.Tensor  # [batch] beta * a_r
    reward_margin: torch.Tensor  # scalar: mean of rewards_chosen - rewards_rejected
    reward_accuracy: torch.Tensor  # scalar: fraction of pairs with rewards_chosen > rewards_rejected
    nll_losses: torch.Tensor | None = None  # [batch] ORPO: -a_c (None for SimPO)
    log_odds_ratios: torch.Tensor | None = None  # [batch] ORPO: logsigmoid(log_odds) (None for SimPO)
    log_odds: torch.Tensor | None = None  # [batch] ORPO: log_odds (None for SimPO)


def _check_pair(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        shapes = f"{tuple(chosen.shape)} and {tuple(rejected.shape)}"
        raise ValueError(f"chosen and rejected log-probs must have one shape [batch], got {shapes}")


def _rewards(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> dict:
    rewards_chosen, rewards_rejected = (beta * chosen).detach(), (beta * rejected).detach()
    return {
        "rewards_chosen": rewards_chosen,
        "rewards_rejected": rewards_rejected,
        "reward_margin": (rewards_chosen - rewards_rejected).mean(),
        "reward_accuracy": (rewards_chosen > rewards_rejected).float().mean(),
    }


def simpo_loss(
    chosen_average_logps: torch.Tensor, rejected_average_logps: torch.Tensor, *, beta: float, gamma: float
) -> PreferenceOutput:
    """SimPO on average token log-probs a_c, a_r: [batch] each. beta > 0, gamma >= 0 (the target margin)."""
    _check_pair(chosen_average_logps, rejected_average_logps, beta)
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    losses = -F.logsigmoid(beta * (chosen_average_logps - rejected_average_logps) - gamma)
    rewards = _rewards(chosen_average_logps, rejected_average_logps, beta)
    return PreferenceOutput(loss=losses.mean(), losses=losses, **rewards)


def log1m_exp(values: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, elementwise (Maechler 2012: each branch is accurate where it is used).

    Never -inf: x is clamped to at most -1e-30 first, so at x = 0 (an average log-prob of 0, probability 1,
    where the true value is -inf) it returns log(1e-30) ~ -69.08, finite, with a gradient of 0 there (the
    clamp's); ORPO's odds term then stays finite instead of making the loss NaN."""
    near_zero = values > -math.log(2.0)
    # Both branches are evaluated; clamp so the unused one never makes a NaN whose gradient would leak.
    return torch.where(
        near_zero,
        torch.log(-torch.expm1(values.clamp(max=-1e-30))),
        torch.log1p(-torch.exp(values.clamp(max=-math.log(2.0)))),
    )


def orpo_loss(
    chosen_average_logps: torch.Tensor, rejected_average_logps: torch.Tensor, *, beta: float
) -> PreferenceOutput:
    """ORPO on average token log-probs a_c, a_r: [batch] each (< 0). beta > 0 is the paper's lambda."""
    _check_pair(chosen_average_logps, rejected_average_logps, beta)
    log_odds = (chosen_average_logps - rejected_average_logps) - (
        log1m_exp(chosen_average_logps) - log1m_exp(rejected_average_logps)
    )
    log_odds_ratios = F.logsigmoid(log_odds)
    nll_losses = -chosen_average_logps
    losses = nll_losses - beta * log_odds_ratios
    return PreferenceOutput(
        loss=losses.mean(),
        losses=losses,
        **_rewards(chosen_average_logps, rejected_average_logps, beta),
        nll_losses=nll_losses.detach(),
        log_odds_ratios=log_odds_ratios.detach(),
        log_odds=log_odds.detach(),
    )
