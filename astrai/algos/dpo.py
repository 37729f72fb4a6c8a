"""Direct Preference Optimization losses (Rafailov et al. 2023) and their IPO / hinge variants.

With sequence log-probs of the policy (pi) and the frozen reference (ref) on a chosen (c) and a
rejected (r) completion of the same prompt, the implicit reward margin is

    h = (pi_c - pi_r) - (ref_c - ref_r)

    "sigmoid": -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)
               (DPO; eps = label_smoothing > 0 is conservative DPO / cDPO, Mitchell 2023:
               the preference label is assumed flipped with probability eps)
    "ipo":     (h - 1 / (2 * beta))^2          (Azar et al. 2023, "IPO")
    "hinge":   relu(1 - beta * h)              (SLiC-HF, Zhao et al. 2023, with the reference)

Departures from the papers:
- IPO's paper scores completions by their *average* token log-prob; this function does not know
  the lengths, so for "ipo" the caller passes length-normalised log-probs if it wants the paper's
  loss (TRL does that). With summed log-probs it is IPO on sequence log-probs.
- SLiC's hinge uses the policy's own margin (pi_c - pi_r); like TRL we use the reference-adjusted h,
  with beta playing the role of 1 / delta.
- label_smoothing applies to "sigmoid" only; passing it with another loss is an error, not ignored.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


class DPOOutput(NamedTuple):
    """loss is differentiable; every other field is detached (for metrics only)."""

    loss: torch.Tensor  # scalar: mean of losses over the batch
    losses: torch.Tensor  # [batch] per-pair loss
    rewards_chosen: torch.Tensor  # [batch] beta * (pi_c - ref_c)
    rewards_rejected: torch.Tensor  # [batch] beta * (pi_r - ref_r)
    reward_margin: torch.Tensor  # scalar: mean of rewards_chosen - rewards_rejected
    reward_accuracy: torch.Tensor  # scalar: fraction of pairs with rewards_chosen > rewards_rejected


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """Preference loss of one batch of (chosen, rejected) pairs; formulas in the module docstring.

    All four log-prob tensors: [batch], sequence log-probs (sum over the completion's tokens,
    see `logprobs.sequence_logprobs`). The reference ones carry no gradient (they are detached
    here in case they do). beta > 0; label_smoothing in [0, 0.5), "sigmoid" only.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f'label_smoothing applies to loss_type "sigmoid" only, not {loss_type!r}')
    shapes = {
        t.shape for t in (policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps)
    }
    if len(shapes) != 1:
        raise ValueError(f"the four log-prob tensors must have one shape [batch], got {sorted(map(tuple, shapes))}")

    reference_chosen_logps = reference_chosen_logps.detach()
    reference_rejected_logps = reference_rejected_logps.detach()
    chosen_log_ratio = policy_chosen_logps - reference_chosen_logps
    rejected_log_ratio = policy_rejected_logps - reference_rejected_logps
    margin = chosen_log_ratio - rejected_log_ratio  # h

    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = torch.relu(1.0 - beta * margin)

    rewards_chosen = (beta * chosen_log_ratio).detach()
    rewards_rejected = (beta * rejected_log_ratio).detach()
    return DPOOutput(
        loss=losses.mean(),
        losses=losses,
        rewards_chosen=rewards_chosen,
        rewards_rejected=rewards_rejected,
        reward_margin=(rewards_chosen - rewards_rejected).mean(),
        reward_accuracy=(rewards_chosen > rewards_rejected).float().mean(),
    )
