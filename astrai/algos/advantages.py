"""Advantages and reward shaping for the online train types: GRPO group baselines, GAE, KL control.

- `grpo_advantages`: A_i = (r_i - mean(group)) / (std(group) + eps) (Shao et al. 2024, DeepSeekMath),
  or A_i = r_i - mean(group) with `normalize_std=False` (Liu et al. 2025, "Dr. GRPO": dividing by the
  std favours groups that are almost all right or all wrong). std is the unbiased (n - 1) one, as in
  TRL and OpenRLHF.
- `rloo_advantages`: A_i = r_i - mean_{j != i} r_j, the leave-one-out baseline (Kool et al. 2019;
  Ahmadian et al. 2024), = G / (G - 1) (r_i - mean(group)).
- `discounted_returns`: G_t = r_t + gamma G_{t+1} over the response tokens (REINFORCE++, Hu 2025: the
  token rewards hold -kl_coef * k1 on every token and the score on the last one).
  REINFORCE++-baseline's advantage is `grpo_advantages(..., normalize_std=False)` whitened over the step;
  the whitening across ranks is the strategy's (it needs a collective).
- `gae` (public name `compute_gae`): generalised advantage estimation (Schulman et al. 2016) over the
  response tokens, with the episode ending after the last valid token (terminal: the value there is 0).
- `kl_shaped_rewards`: the per-token reward of RLHF PPO (Ziegler et al. 2019; Ouyang et al. 2022):
  -kl_coef * KL on every token, plus the sequence reward on the last one.
- `AdaptiveKLController` / `FixedKLController`: Ziegler et al. 2019, section 2.2.

These produce targets: `gae` detaches its inputs and returns tensors without gradient.
Whitening the advantages (`masked.masked_whiten`) is left to the caller.
"""

import torch


def _groups(rewards: torch.Tensor, group_size: int, why_two: str) -> torch.Tensor:
    """rewards [num_prompts * group_size] (groups contiguous) as [num_prompts, group_size], checked."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 ({why_two}), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of GRPO.

    rewards: [num_prompts * group_size], the group_size completions of each prompt contiguous
    ([p0 c0, p0 c1, ..., p1 c0, ...]). Returns [num_prompts * group_size]:
    (r - group mean) / (group std + eps), or r - group mean when `normalize_std` is False.
    A group whose rewards are all equal gets advantages 0 (no learning signal).
    """
    grouped = _groups(rewards, group_size, "a group of one has no baseline")
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages: A_i = r_i - (sum_j r_j - r_i) / (G - 1) within each group.

    rewards: [num_prompts * group_size], groups contiguous as in `grpo_advantages`. Returns the same
    shape. No std division (RLOO has none); a group of equal rewards gets 0.
    """
    grouped = _groups(rewards, group_size, "leave-one-out needs another response")
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens, G = 0 after the last one; [batch, response_len].

    rewards, mask: [batch, response_len], mask a prefix of each row (right padding); no gradient.
    This is `gae` with values 0 and lambda 1 (then A_t = G_t), written so.
    """
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return advantages


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded response tokens.

    rewards, values, mask: [batch, response_len]; mask marks the valid response tokens, a prefix of
    each row (right padding). With V_{t+1} = 0 after the last valid token (terminal):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t        (the critic's target)

    Returns (advantages, returns), both [batch, response_len], 0 at padded positions, no gradient.
    One backward pass over response_len, vectorised over the batch.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values, mask must share one [batch, response_len] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    # Padding holds junk (or NaN); zeroing it makes V_{t+1} = 0 and r_t = 0 past the end, so the
    # recursion needs no per-row lengths.
    rewards = torch.where(valid, rewards.detach(), torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    values = torch.where(valid, values.detach(), torch.zeros((), dtype=values.dtype, device=values.device))
    response_len = rewards.shape[1]
    advantages_reversed = []
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(response_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
        advantages_reversed.append(next_advantage)
    if advantages_reversed:
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
    else:
        advantages = torch.zeros_like(rewards)
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    return advantages, advantages + values


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The public name of `gae`; other tools call it positionally or by these parameter names, so
    they are a contract. Returns (advantages, returns), each [batch, response_len], from per-token
    rewards, values and a 0/1 mask of valid response tokens [batch, response_len] (right-padded).
    See `gae` for the recursion and the terminal convention."""
    return gae(rewards, values, mask, gamma=gamma, lam=lam)


def kl_shaped_rewards(
    sequence_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float | torch.Tensor
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * kl_t on every valid token, + the sequence reward on the last one.

    sequence_rewards: [batch] (e.g. a reward model's score); kl, mask: [batch, response_len], kl a
    per-token estimate (see `kl.py`), mask a prefix of each row. Returns [batch, response_len],
    0 at padded positions. A row without valid tokens gets no reward at all.
    """
    if kl.shape != mask.shape or sequence_rewards.shape != kl.shape[:1]:
        raise ValueError(
            f"expected sequence_rewards [batch] and kl, mask [batch, response_len], got "
            f"{tuple(sequence_rewards.shape)}, {tuple(kl.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    is_last = valid & ~next_valid
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    penalty = torch.where(valid, -kl_coef * kl, zero)
    return penalty + torch.where(is_last, sequence_rewards.to(kl.dtype).unsqueeze(1), zero)


class AdaptiveKLController:
    """KL coefficient steered toward a target KL (Ziegler et al. 2019, eq. 2.2):

        error = clip(current_kl / target - 1, -0.2, 0.2)
        value <- value * (1 + error * n_steps / horizon)

    `current_kl` is the measured KL of the last batch (nats per sequence or per token: the same
    unit as `target`); `n_steps` the samples (or steps) that batch counted for.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if not target > 0 or not horizon > 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant KL coefficient with the interface of `AdaptiveKLController`."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
