"""Whole groups cut out of rollouts and joined into one: what dynamic sampling (`rl.dynamic_sampling`)
moves between sampling rounds and ranks. A group is the `group_size` contiguous sequences of one prompt.

Rollouts of different rounds have different widths (the longest prompt P, the longest response R of
their batch), so joining re-pads: prompts on the left, responses on the right, with the pad token and
mask 0 (behaviour log-probs 0), exactly the layout `generate_rollout` makes (see `sequences.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrai.rollout.generation import RolloutResult

ROW_TENSORS = ("truncated", "rewards", "overlong_penalties", "loss_rows")  # [N] fields, None or a tensor
ROW_LISTS = ("prompt_texts", "response_texts", "messages", "rows")


def select_groups(rollout: RolloutResult, groups: Sequence[int], device: torch.device | str = "cpu") -> RolloutResult:
    """The sequences of `groups` (indices of the rollout's groups, in the order given), moved to `device`.
    Only the sampling-stage fields travel (sequences, behaviour log-probs, rewards); targets are made later."""
    size = rollout.group_size
    rows = [group * size + member for group in groups for member in range(size)]
    index = torch.tensor(rows, dtype=torch.long, device=rollout.response_ids.device)

    def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.index_select(0, index).to(device)

    return RolloutResult(
        prompt_ids=pick(rollout.prompt_ids),
        prompt_mask=pick(rollout.prompt_mask),
        response_ids=pick(rollout.response_ids),
        response_mask=pick(rollout.response_mask),
        behaviour_logprobs=pick(rollout.behaviour_logprobs),
        **{name: pick(getattr(rollout, name)) for name in ROW_TENSORS},
        **{name: [getattr(rollout, name)[row] for row in rows] for name in ROW_LISTS},
        reward_components={name: pick(values) for name, values in rollout.reward_components.items()},
        group_size=size,
        policy_version=rollout.policy_version,
    )


def _pad_columns(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    padding = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([padding, tensor] if left else [tensor, padding], dim=1)


def concatenate_rollouts(parts: Sequence[RolloutResult], pad_token_id: int) -> RolloutResult:
    """One RolloutResult of every part's sequences in order (all parts on one device, same group size
    and policy version, and the same optional fields set), re-padded to the widest prompt and response."""
    if not parts:
        raise ValueError("concatenate_rollouts needs at least one part")
    prompt_width = max(part.prompt_ids.shape[1] for part in parts)
    response_width = max(part.response_ids.shape[1] for part in parts)

    def join(name: str, width: int, value: float, left: bool) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        if tensors[0] is None:
            return None
        return torch.cat([_pad_columns(tensor, width, value, left) for tensor in tensors])

    def stack(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if tensors[0] is None else torch.cat(tensors)

    first = parts[0]
    return RolloutResult(
        prompt_ids=join("prompt_ids", prompt_width, pad_token_id, left=True),
        prompt_mask=join("prompt_mask", prompt_width, 0, left=True),
        response_ids=join("response_ids", response_width, pad_token_id, left=False),
        response_mask=join("response_mask", response_width, 0, left=False),
        behaviour_logprobs=join("behaviour_logprobs", response_width, 0.0, left=False),
        **{name: stack([getattr(part, name) for part in parts]) for name in ROW_TENSORS},
        **{name: [item for part in parts for item in getattr(part, name)] for name in ROW_LISTS},
        reward_components={
            name: torch.cat([part.reward_components[name] for part in parts]) for name in first.reward_components
        },
        group_size=first.group_size,
        policy_version=first.policy_version,
    )
