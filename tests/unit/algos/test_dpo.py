"""DPO / IPO / hinge losses on two pairs worked out by hand.

Pair 1: pi_c = -1, pi_r = -3, ref_c = -2, ref_r = -2  ->  h = (-1 + 3) - (-2 + 2) =  2
Pair 2: pi_c = -2, pi_r = -1, ref_c = -1, ref_r = -1  ->  h = (-2 + 1) - (-1 + 1) = -1
beta = 0.5, so beta * h = 1 and -0.5.
"""

import math

import pytest
import torch

from astrai.algos.dpo import dpo_loss

BETA = 0.5


def pairs(requires_grad: bool = False):
    policy_chosen = torch.tensor([-1.0, -2.0], requires_grad=requires_grad)
    policy_rejected = torch.tensor([-3.0, -1.0], requires_grad=requires_grad)
    reference_chosen = torch.tensor([-2.0, -1.0])
    reference_rejected = torch.tensor([-2.0, -1.0])
    return policy_chosen, policy_rejected, reference_chosen, reference_rejected


def test_sigmoid_by_hand():
    output = dpo_loss(*pairs(), beta=BETA, loss_type="sigmoid")
    # -logsigmoid(x) = log(1 + exp(-x)):  log(1 + e^-1) = 0.31326169,  log(1 + e^0.5) = 0.97407698
    assert output.losses.tolist() == pytest.approx([0.31326169, 0.97407698], abs=1e-6)
    assert output.loss.item() == pytest.approx((0.31326169 + 0.97407698) / 2, abs=1e-6)


def test_conservative_sigmoid_by_hand():
    output = dpo_loss(*pairs(), beta=BETA, loss_type="sigmoid", label_smoothing=0.1)
    # 0.9 * log(1 + e^-x) + 0.1 * log(1 + e^x), and log(1 + e^x) = x + log(1 + e^-x):
    # pair 1 (x = 1):    0.31326169 + 0.1 * 1    = 0.41326169
    # pair 2 (x = -0.5): 0.97407698 + 0.1 * -0.5 = 0.92407698
    assert output.losses.tolist() == pytest.approx([0.41326169, 0.92407698], abs=1e-6)


def test_ipo_by_hand():
    output = dpo_loss(*pairs(), beta=BETA, loss_type="ipo")
    # (h - 1 / (2 * 0.5))^2 = (h - 1)^2: (2 - 1)^2 = 1, (-1 - 1)^2 = 4
    assert output.losses.tolist() == pytest.approx([1.0, 4.0])
    assert output.loss.item() == pytest.approx(2.5)


def test_hinge_by_hand():
    output = dpo_loss(*pairs(), beta=BETA, loss_type="hinge")
    # relu(1 - beta * h): relu(1 - 1) = 0, relu(1 + 0.5) = 1.5
    assert output.losses.tolist() == pytest.approx([0.0, 1.5])


def test_rewards_and_metrics_by_hand():
    output = dpo_loss(*pairs(requires_grad=True), beta=BETA)
    # rewards_chosen = 0.5 * (pi_c - ref_c) = 0.5 * (1, -1); rewards_rejected = 0.5 * (-1, 0)
    assert output.rewards_chosen.tolist() == [0.5, -0.5]
    assert output.rewards_rejected.tolist() == [-0.5, 0.0]
    assert output.reward_margin.item() == pytest.approx((1.0 + -0.5) / 2)  # margins 1, -0.5
    assert output.reward_accuracy.item() == 0.5  # pair 1 right, pair 2 wrong
    assert output.loss.requires_grad
    for metric in (output.rewards_chosen, output.rewards_rejected, output.reward_margin, output.reward_accuracy):
        assert not metric.requires_grad


def test_sigmoid_gradient_by_hand():
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = pairs(requires_grad=True)
    dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=BETA).loss.backward()
    # d/dpi_c of mean(-logsigmoid(beta h)) = -beta * sigmoid(-beta h) / batch
    sigmoid = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    expected = [-BETA * sigmoid(-1.0) / 2, -BETA * sigmoid(0.5) / 2]  # -0.0672355, -0.1556223
    assert policy_chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)
    assert policy_rejected.grad.tolist() == pytest.approx([-g for g in expected], abs=1e-6)


def test_reference_gradients_are_cut():
    reference_chosen = torch.tensor([-2.0, -1.0], requires_grad=True)
    policy_chosen, policy_rejected, _, reference_rejected = pairs(requires_grad=True)
    dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=BETA).loss.backward()
    assert reference_chosen.grad is None


def test_invalid_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo_loss(*pairs(), beta=BETA, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*pairs(), beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo_loss(*pairs(), beta=BETA, label_smoothing=0.5)
    with pytest.raises(ValueError, match='"sigmoid" only'):
        dpo_loss(*pairs(), beta=BETA, loss_type="ipo", label_smoothing=0.1)
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = pairs()
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(policy_chosen[:1], policy_rejected, reference_chosen, reference_rejected, beta=BETA)
