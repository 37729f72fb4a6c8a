"""Right-padded micro-batches: `input_ids`, `attention_mask`, `loss_mask`, each `[batch, max_len]`."""

from __future__ import annotations

import torch


def pad_right(sequences: list[list[int]], value: int) -> torch.Tensor:
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor(
        [list(sequence) + [value] * (longest - len(sequence)) for sequence in sequences], dtype=torch.long
    )


def collate_token_rows(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": pad_right([row["input_ids"] for row in rows], pad_token_id),
        "attention_mask": pad_right([[1] * len(row["input_ids"]) for row in rows], 0),
        "loss_mask": pad_right([row["loss_mask"] for row in rows], 0),
    }
