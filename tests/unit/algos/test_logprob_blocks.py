"""token_logprobs and entropy_from_logits go a block of sequences at a time (`row_blocks`) instead of one
sequence at a time: the values and gradients are those of the one-row-at-a-time computation, whatever the
block size, and a block never holds more than BLOCK_ELEMENTS logits unless one row does."""

from __future__ import annotations

import pytest
import torch

from astrai.algos import logprobs as logprobs_module
from astrai.algos.logprobs import row_blocks, token_logprobs
from astrai.algos.ppo import entropy_from_logits


def row_by_row(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The former computation: each [seq_len, vocab] row alone, in float32."""
    logps, entropies = [], []
    for row, row_labels in zip(logits, labels):
        row = row.float()
        safe = row_labels.clamp(min=0)
        chosen = torch.gather(row, -1, safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1)
        logps.append(torch.where(row_labels < 0, torch.zeros_like(chosen), chosen))
        probabilities = torch.softmax(row, dim=-1)
        entropies.append(torch.logsumexp(row, dim=-1) - (probabilities * row).sum(dim=-1))
    return torch.stack(logps), torch.stack(entropies)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_elements", [2**22, 7 * 21, 1])  # all rows in one block, 2 rows a block, one row
def test_blocks_give_the_row_by_row_values_and_gradients(monkeypatch, dtype, block_elements):
    monkeypatch.setattr(logprobs_module, "BLOCK_ELEMENTS", block_elements)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, 21, generator=generator) * 3
    labels = torch.randint(0, 21, (5, 7), generator=generator)
    labels[1, 3:] = -100
    results = []
    for compute in ("blocks", "rows"):
        logits = base.to(dtype).requires_grad_()
        if compute == "blocks":
            logps, entropy = token_logprobs(logits, labels), entropy_from_logits(logits)
        else:
            logps, entropy = row_by_row(logits, labels)
        (logps.sum() + 0.5 * entropy.sum()).backward()
        results.append((logps.detach(), entropy.detach(), logits.grad.float()))
    for name, blocked, plain in zip(("logprobs", "entropy", "gradient"), *results):
        assert blocked.dtype == plain.dtype == torch.float32
        # a bfloat16 gradient sums its two paths in bfloat16, in an order of its own: equal to its precision
        tolerance = 2**-6 if name == "gradient" and dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(blocked, plain, atol=tolerance, rtol=tolerance, msg=name)


def test_block_size_bounds_the_logits_held_at_once(monkeypatch):
    monkeypatch.setattr(logprobs_module, "BLOCK_ELEMENTS", 100)
    assert row_blocks(torch.zeros(8, 3, 10)) == 3  # 30 entries a row: 3 rows in 100
    assert row_blocks(torch.zeros(8, 30, 10)) == 1  # a row over the bound still goes alone
    assert token_logprobs(torch.zeros(0, 3, 10), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
    assert entropy_from_logits(torch.zeros(0, 3, 10)).shape == (0, 3)
