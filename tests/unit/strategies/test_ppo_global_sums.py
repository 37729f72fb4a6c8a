"""online_ppo's step-level statistics from per-rank sums: explained variance and the value/advantage
metrics from the summed token statistics (two halves give the whole batch), and the all-rank whitening
of the advantages (on one rank, masked_whiten)."""

from __future__ import annotations

import pytest
import torch

from astrai.algos import explained_variance, global_standardize, masked_whiten
from astrai.training.step_metrics import target_metrics


def test_step_explained_variance_from_global_sums_equals_the_batch_formula():
    """The loop sums per-rank token statistics over ranks; two halves give the whole batch's value."""
    generator = torch.Generator().manual_seed(3)
    values, returns = torch.randn(6, 5, generator=generator), torch.randn(6, 5, generator=generator)
    mask = torch.rand(6, 5, generator=generator) > 0.3
    totals: dict[str, float] = {}
    for half in (slice(0, 3), slice(3, 6)):
        valid = mask[half]
        v, r = values[half][valid].double(), returns[half][valid].double()
        for key, value in (
            ("tokens", valid.sum()),
            ("values", v.sum()),
            ("returns", r.sum()),
            ("returns_squared", (r**2).sum()),
            ("advantages", (r - v).sum()),
            ("advantages_squared", ((r - v) ** 2).sum()),
        ):
            totals[f"targets/{key}"] = totals.get(f"targets/{key}", 0.0) + float(value)
    record = target_metrics(totals)
    assert record["explained_variance"] == pytest.approx(explained_variance(values, returns, mask).item(), abs=1e-5)
    assert record["values_mean"] == pytest.approx(values[mask].mean().item(), abs=1e-6)
    assert record["advantages_std"] == pytest.approx((returns - values)[mask].std(unbiased=False).item(), abs=1e-6)


def test_global_standardize_on_one_rank_is_masked_whiten():
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(4, 6, generator=generator)
    mask = torch.rand(4, 6, generator=generator) > 0.4
    whitened = global_standardize(advantages, mask)
    assert torch.equal(global_standardize(advantages, mask, lambda sums: list(sums)), whitened)
    assert torch.allclose(whitened, masked_whiten(advantages, mask), atol=1e-6)
    assert (whitened[~mask] == 0).all()
