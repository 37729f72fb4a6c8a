"""Summed next-token cross-entropy against a plain loop."""

from __future__ import annotations

import math

import torch

from astrai.algos.cross_entropy import next_token_cross_entropy_sum


def test_sum_matches_loop_and_ignores_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    input_ids = torch.randint(0, 7, (2, 5))
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    expected, count = 0.0, 0
    for b in range(2):
        for t in range(1, 5):
            if loss_mask[b, t]:
                row = logits[b, t - 1]
                expected -= row[input_ids[b, t]].item() - math.log(sum(math.exp(v) for v in row.tolist()))
                count += 1
    loss_sum, tokens = next_token_cross_entropy_sum(logits, input_ids, loss_mask)
    assert tokens.item() == count == 5
    assert abs(loss_sum.item() - expected) < 1e-5
    # Garbage in masked-out positions changes nothing.
    logits[1, 3:] = 1e4
    assert abs(next_token_cross_entropy_sum(logits, input_ids, loss_mask)[0].item() - expected) < 1e-5
