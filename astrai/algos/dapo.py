"""DAPO's reward-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

- `overlong_penalty`: the soft length penalty of eq. 13, added to the task reward,

      R_length(y) = 0                                  |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                  = -1                                 |y| > L_max

  times `penalty_factor` (verl's `overlong_buffer.penalty_factor`; 1 in the paper).
- `informative_groups`: dynamic sampling's filter: a group whose rewards are all equal has GRPO
  advantages exactly 0, so it carries no policy gradient and is dropped (verl filters on std > 0;
  an exact equality test says the same without a float threshold).
"""

import torch


def overlong_penalty(
    lengths: torch.Tensor, *, max_tokens: int, buffer_tokens: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO eq. 13 times `penalty_factor`: lengths [N] (response tokens, EOS included) -> penalties [N] float32,
    each in [-penalty_factor, 0]: 0 up to max_tokens - buffer_tokens, then falling linearly to -penalty_factor
    at max_tokens, and -penalty_factor beyond it."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(
            f"need 0 < buffer_tokens <= max_tokens, got buffer_tokens {buffer_tokens}, max_tokens {max_tokens}"
        )
    exceeding = (lengths.float() - (max_tokens - buffer_tokens)).clamp(min=0.0)
    return -(exceeding / buffer_tokens).clamp(max=1.0) * penalty_factor


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [num_groups * group_size], each group contiguous -> [num_groups] bool: True where the
    group's rewards are not all equal (its advantages are not all 0)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of {group_size} entries, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.reshape(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
