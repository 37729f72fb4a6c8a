"""The `rm` Bradley-Terry loss against numbers computed by hand.

-log sigmoid(x) = log(1 + e^-x):  x = 2 -> 0.126928011, x = 0 -> log 2 = 0.693147181,
x = -2 -> 2.126928011, x = 1 -> 0.313261688; its derivative in x is -sigmoid(-x) (x = 2 -> -0.119202922).
"""

from __future__ import annotations

import math

import pytest
import torch

from astrai.algos.reward_model import bradley_terry_loss

CHOSEN = [2.0, 0.0, -1.0]
REJECTED = [0.0, 0.0, 1.0]


def test_plain_bradley_terry_per_pair_losses_accuracy_and_margins():
    result = bradley_terry_loss(torch.tensor(CHOSEN), torch.tensor(REJECTED))
    assert result.losses.tolist() == pytest.approx([0.126928011, 0.693147181, 2.126928011], abs=1e-7)
    assert result.accuracy.tolist() == [1.0, 0.0, 0.0]  # a tie is no success
    assert result.margins.tolist() == [2.0, 0.0, -2.0]


def test_the_margin_is_subtracted_inside_the_sigmoid_as_llama_2():
    margin = torch.tensor([1.0, 0.0, -2.0])
    result = bradley_terry_loss(torch.tensor(CHOSEN), torch.tensor(REJECTED), margin)
    # x = 2 - 1 = 1; 0 - 0 = 0; -2 + 2 = 0
    assert result.losses.tolist() == pytest.approx([0.313261688, 0.693147181, 0.693147181], abs=1e-7)
    assert result.margins.tolist() == [2.0, 0.0, -2.0]  # what the model separates by, m not subtracted


def test_centring_adds_coef_times_the_squared_sum_of_the_pair():
    result = bradley_terry_loss(torch.tensor(CHOSEN), torch.tensor(REJECTED), center_coef=0.5)
    # (2 + 0)^2 = 4, 0, (-1 + 1)^2 = 0
    assert result.losses.tolist() == pytest.approx([0.126928011 + 2.0, 0.693147181, 2.126928011], abs=1e-7)
    # mean over pairs = TRL's mean(-logsigmoid) + coef * mean((r_c + r_r)^2)
    expected = (0.126928011 + 0.693147181 + 2.126928011) / 3 + 0.5 * (4 + 0 + 0) / 3
    assert float(result.losses.mean()) == pytest.approx(expected, abs=1e-7)


def test_gradients_by_hand():
    chosen = torch.tensor([2.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected, center_coef=0.25).losses.sum().backward()
    sigmoid_minus_two = 1 / (1 + math.exp(2))  # 0.119202922
    # d/dr_c = -sigmoid(-2) + 2 * 0.25 * (2 + 0); d/dr_r = +sigmoid(-2) + 2 * 0.25 * 2
    assert chosen.grad.item() == pytest.approx(-sigmoid_minus_two + 1.0, abs=1e-7)
    assert rejected.grad.item() == pytest.approx(sigmoid_minus_two + 1.0, abs=1e-7)


def test_only_the_losses_carry_gradients():
    chosen = torch.tensor([1.0, 3.0], requires_grad=True)
    result = bradley_terry_loss(chosen, torch.zeros(2))
    assert result.losses.requires_grad and not result.accuracy.requires_grad and not result.margins.requires_grad


@pytest.mark.parametrize(
    "chosen, rejected, margin, coef, message",
    [
        (torch.zeros(2), torch.zeros(3), None, 0.0, "one shape"),
        (torch.zeros(2, 1), torch.zeros(2, 1), None, 0.0, "one shape"),
        (torch.zeros(2), torch.zeros(2), torch.zeros(3), 0.0, "margin"),
        (torch.zeros(2), torch.zeros(2), None, -1.0, "center_coef"),
    ],
)
def test_bad_shapes_and_coefficients_are_refused(chosen, rejected, margin, coef, message):
    with pytest.raises(ValueError, match=message):
        bradley_terry_loss(chosen, rejected, margin, coef)
