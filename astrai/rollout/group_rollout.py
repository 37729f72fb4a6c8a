"""A rollout shared by the ranks of a sequence-parallel group (`parallel.sequence_parallel_size`).

The ranks of a group draw the same prompts and must score and train on the same sequences (each holds a cut of
every one). Generation stays whole-sequence (its memory is the KV cache, not activations), so the group splits
it: rank s of the group samples the s-th share of the prompts, with its own seed as a rank of a data-parallel
run would, and the group gathers the shares in rank order. Every rank then holds the whole rollout, padded to the
group's longest prompt (on the left) and response (on the right), and scores it with the sequence-parallel forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from astrai.rollout.generation import RolloutResult

TENSORS_LEFT = ("prompt_ids", "prompt_mask")  # left-padded [N, P]
TENSORS_RIGHT = ("response_ids", "response_mask", "behaviour_logprobs")  # right-padded [N, R]
PER_SEQUENCE = ("truncated", "rewards", "overlong_penalties")  # [N] (the rewards: each rank scored its share)
LISTS = ("prompt_texts", "response_texts", "messages", "rows")


def group_share(examples: list, size: int, rank: int) -> list:
    """The `rank`-th of `size` equal shares of the group's prompts (the schema makes them divide)."""
    share = len(examples) // size
    return examples[rank * share : (rank + 1) * share]


def gather_rollout(rollout: RolloutResult, group, size: int, pad_token_id: int) -> RolloutResult:
    """Every share of the group's rollout, in rank order, on every rank of the group (one object gather)."""
    device = rollout.response_ids.device
    mine = {name: _cpu(getattr(rollout, name)) for name in (*TENSORS_LEFT, *TENSORS_RIGHT, *PER_SEQUENCE, *LISTS)}
    mine["reward_components"] = {name: values.cpu() for name, values in rollout.reward_components.items()}
    shares: list[dict] = [None] * size
    dist.all_gather_object(shares, mine, group=group)
    prompt_len = max(share["prompt_ids"].shape[1] for share in shares)
    response_len = max(share["response_ids"].shape[1] for share in shares)
    fills = {"prompt_ids": pad_token_id, "response_ids": pad_token_id}
    merged = {}
    for name in TENSORS_LEFT:
        merged[name] = torch.cat([_pad(share[name], prompt_len, fills.get(name, 0), left=True) for share in shares])
    for name in TENSORS_RIGHT:
        if shares[0][name] is None:
            merged[name] = None
            continue
        merged[name] = torch.cat([_pad(share[name], response_len, fills.get(name, 0), left=False) for share in shares])
    for name in PER_SEQUENCE:
        merged[name] = None if shares[0][name] is None else torch.cat([share[name] for share in shares])
    for name in LISTS:
        merged[name] = [item for share in shares for item in share[name]]
    tensors = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in merged.items()}
    components = {
        name: torch.cat([share["reward_components"][name] for share in shares]).to(device)
        for name in shares[0]["reward_components"]
    }
    return RolloutResult(
        **tensors, reward_components=components, group_size=rollout.group_size, policy_version=rollout.policy_version
    )


def _cpu(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _pad(tensor: torch.Tensor, length: int, fill, *, left: bool) -> torch.Tensor:
    missing = length - tensor.shape[1]
    if missing == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=fill)
