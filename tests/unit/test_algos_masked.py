"""Masked reductions against hand arithmetic and Python's `statistics` module."""

import math
import statistics

import pytest
import torch

from astrai.algos.masked import masked_aggregate, masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # valid: 1, 2 | 4


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(VALUES, MASK).item() == 7.0  # 1 + 2 + 4
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7.0 / 3.0)
    assert masked_sum(VALUES, MASK, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(VALUES, MASK, dim=0).tolist() == [2.5, 2.0, 0.0]  # (1+4)/2, 2/1, empty column -> 0


def test_bool_and_float_masks_agree():
    assert torch.equal(masked_mean(VALUES, MASK), masked_mean(VALUES, MASK.bool()))
    assert torch.equal(masked_var(VALUES, MASK), masked_var(VALUES, MASK.bool()))


def test_empty_mask_gives_zero_and_finite_gradient():
    values = torch.randn(2, 3, requires_grad=True)
    empty = torch.zeros(2, 3)
    mean = masked_mean(values, empty)
    assert mean.item() == 0.0
    mean.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert masked_mean(values, empty, dim=-1).tolist() == [0.0, 0.0]
    assert masked_var(values, empty).item() == 0.0


def test_junk_in_padding_reaches_neither_value_nor_gradient():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("-inf")]], requires_grad=True)
    mean = masked_mean(values, MASK)
    assert mean.item() == pytest.approx(7.0 / 3.0)
    mean.backward()
    assert torch.allclose(values.grad, MASK / 3.0)


def test_masked_var_against_statistics_module():
    # valid 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14.0 / 9.0)  # / 3
    assert masked_var(VALUES, MASK, unbiased=True).item() == pytest.approx(14.0 / 6.0)  # / 2
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=generator) > 0.4
    kept = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    assert masked_var(values, mask).item() == pytest.approx(statistics.variance(kept))
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(kept))


def test_masked_var_with_one_valid_entry_is_zero():
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(VALUES, one, unbiased=True).item() == 0.0
    assert masked_var(VALUES, one, unbiased=False).item() == 0.0


def test_masked_whiten_by_hand():
    whitened = masked_whiten(VALUES, MASK)
    scale = math.sqrt(7.0 / 3.0 + 1e-8)  # unbiased var of 1, 2, 4 is 7/3
    expected = torch.tensor([[(1 - 7 / 3) / scale, (2 - 7 / 3) / scale, 0.0], [(4 - 7 / 3) / scale, 0.0, 0.0]])
    assert torch.allclose(whitened, expected)
    assert masked_mean(whitened, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, MASK).item() == pytest.approx(1.0, abs=1e-6)
    kept_mean = masked_whiten(VALUES, MASK, shift_mean=False)
    assert torch.allclose(kept_mean, torch.where(MASK.bool(), expected + 7.0 / 3.0, torch.zeros(())))


def test_aggregate_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row empty
    assert masked_aggregate(losses, mask, "token_mean").item() == pytest.approx(10.0 / 4.0)
    assert masked_aggregate(losses, mask, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2.0)
    assert masked_aggregate(losses, mask, "global", global_token_count=8).item() == pytest.approx(10.0 / 8.0)
    count = torch.tensor(5.0)
    assert masked_aggregate(losses, mask, "global", global_token_count=count).item() == pytest.approx(2.0)


def test_aggregate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        masked_aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="needs global_token_count"):
        masked_aggregate(VALUES, MASK, "global")
    with pytest.raises(ValueError, match="must be > 0"):
        masked_aggregate(VALUES, MASK, "global", global_token_count=0)
    with pytest.raises(ValueError, match="only used with"):
        masked_aggregate(VALUES, MASK, "token_mean", global_token_count=3)
