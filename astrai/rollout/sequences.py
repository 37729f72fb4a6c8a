"""The one place where "sequence = prompt + response" and its masks are made.

Generation, `grpo` and `online_ppo` all use this layout (N sequences, P prompt columns, R response columns):

    prompt_ids, prompt_mask        [N, P]      LEFT-padded: every prompt ends at column P - 1, so
                                               generation appends to all rows at the same column
    response_ids, response_mask    [N, R]      RIGHT-padded; the mask keeps every token up to and
                                               including the first EOS (the EOS is trained: it is
                                               the policy's decision to stop)
    input_ids, attention_mask      [N, P + R]  prompt ++ response
    position_ids                   [N, P + R]  cumsum(attention_mask) - 1, 0 on left padding: the
                                               positions `generate` gives a left-padded batch; a plain
                                               forward would count the padding and disagree with it

Response token t sits at column P + t and is predicted by the logits at column P + t - 1, so the
response logits of a forward over the whole sequence are logits[:, P - 1 : P + R - 1]. The forwards that
score these sequences (log-probs, entropy, critic values) are the job's `ScoringForward` (scoring.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both [N, longest], padding on the left. Masks are int64 0/1."""
    longest = max(len(sequence) for sequence in sequences)
    ids = [[pad_token_id] * (longest - len(sequence)) + list(sequence) for sequence in sequences]
    mask = [[0] * (longest - len(sequence)) + [1] * len(sequence) for sequence in sequences]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _is_eos(token_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    eos = torch.tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids), device=token_ids.device
    )
    return torch.isin(token_ids, eos)


def response_mask(response_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """[N, R] int64: 1 on every token up to and including the row's first EOS, 0 after it.

    A row without EOS (cut at max_new_tokens) keeps all R tokens. Whatever follows the first EOS
    (`generate` pads finished rows with the pad token, which may be the EOS itself) is masked.
    """
    is_eos = _is_eos(response_ids, eos_token_ids).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def truncated_rows(response_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """[N] bool: the row has no EOS, i.e. generation stopped at max_new_tokens."""
    return ~_is_eos(response_ids, eos_token_ids).any(dim=1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] positions counting only attended tokens (0 on left padding), as `generate` assigns them."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def join_sequences(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """prompt [N, P] ++ response [N, R] -> input_ids, attention_mask, position_ids [N, P + R],
    plus response_ids and response_mask [N, R] (what the losses read)."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "response_ids": response_ids,
        "response_mask": response_mask,
    }
