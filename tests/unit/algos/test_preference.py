"""SimPO and ORPO against independent float64 loops written from the papers' equations.

Each pair's completions have ragged lengths; the per-token log-probs are random (< 0). The loops
below compute the average log-prob by a Python sum over the real tokens and the losses with `math`
(SimPO eq. 6; ORPO eqs. 4-7 with odds = P / (1 - P) written literally), and their gradients by
central finite differences of the same loop, against torch's autograd through the module's code.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from astrai.algos.preference import log1m_exp, orpo_loss, simpo_loss

LENGTHS = [(3, 7), (1, 4), (9, 2), (5, 5)]  # (chosen, rejected) completion lengths of four pairs


def token_logps(seed: int = 0) -> list[tuple[list[float], list[float]]]:
    generator = random.Random(seed)

    def side(length):
        return [-generator.uniform(0.05, 3.0) for _ in range(length)]

    return [(side(c), side(r)) for c, r in LENGTHS]


def simpo_reference(pairs, beta: float, gamma: float) -> float:
    """Mean over pairs of -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)."""
    total = 0.0
    for chosen, rejected in pairs:
        z = beta / len(chosen) * sum(chosen) - beta / len(rejected) * sum(rejected) - gamma
        total += -math.log(1.0 / (1.0 + math.exp(-z)))
    return total / len(pairs)


def orpo_reference(pairs, lam: float) -> float:
    """Mean over pairs of L_SFT + lambda * L_OR, L_SFT = -1/m sum_t log P(y_w,t), P(y|x) = exp(mean log-prob),
    odds = P / (1 - P), L_OR = -log sigma(log(odds_w / odds_l))."""
    total = 0.0
    for chosen, rejected in pairs:
        probability_w, probability_l = math.exp(sum(chosen) / len(chosen)), math.exp(sum(rejected) / len(rejected))
        odds_w, odds_l = probability_w / (1 - probability_w), probability_l / (1 - probability_l)
        sft = -sum(chosen) / len(chosen)
        odds_ratio = -math.log(1.0 / (1.0 + 1.0 / (odds_w / odds_l)))
        total += sft + lam * odds_ratio
    return total / len(pairs)


def averages(pairs, dtype=torch.float64):
    """The module's inputs from the same tokens, computed with torch (masked sum / length, as the strategy does)."""
    width = max(max(c, r) for c, r in LENGTHS)
    rows = [side for pair in pairs for side in pair]
    values = torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=dtype, requires_grad=True)
    mask = torch.tensor([[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows], dtype=dtype)
    means = (values * mask).sum(-1) / mask.sum(-1)
    return values, means[0::2], means[1::2]


def finite_difference(function, pairs, pair: int, side: int, token: int, step: float = 1e-6) -> float:
    def shifted(delta):
        copy = [(list(c), list(r)) for c, r in pairs]
        copy[pair][side][token] += delta
        return function(copy)

    return (shifted(step) - shifted(-step)) / (2 * step)


@pytest.mark.parametrize("beta, gamma", [(2.5, 1.25), (0.1, 0.0), (1.0, 3.0)])
def test_simpo_matches_the_paper_loop_with_gradients(beta, gamma):
    pairs = token_logps(1)
    values, chosen, rejected = averages(pairs)
    output = simpo_loss(chosen, rejected, beta=beta, gamma=gamma)
    assert output.loss.item() == pytest.approx(simpo_reference(pairs, beta, gamma), rel=1e-12, abs=1e-12)
    output.loss.backward()
    for pair, (c, r) in enumerate(LENGTHS):
        for side, length in ((0, c), (1, r)):
            for token in range(length):
                expected = finite_difference(lambda p: simpo_reference(p, beta, gamma), pairs, pair, side, token)
                assert values.grad[2 * pair + side, token].item() == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert output.rewards_chosen.tolist() == pytest.approx([beta * sum(c) / len(c) for c, _ in pairs], rel=1e-12)
    assert output.rewards_rejected.tolist() == pytest.approx([beta * sum(r) / len(r) for _, r in pairs], rel=1e-12)


@pytest.mark.parametrize("lam", [0.1, 0.25, 1.0])
def test_orpo_matches_the_paper_loop_with_gradients(lam):
    pairs = token_logps(2)
    values, chosen, rejected = averages(pairs)
    output = orpo_loss(chosen, rejected, beta=lam)
    assert output.loss.item() == pytest.approx(orpo_reference(pairs, lam), rel=1e-12, abs=1e-12)
    output.loss.backward()
    for pair, (c, r) in enumerate(LENGTHS):
        for side, length in ((0, c), (1, r)):
            for token in range(length):
                expected = finite_difference(lambda p: orpo_reference(p, lam), pairs, pair, side, token)
                assert values.grad[2 * pair + side, token].item() == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # the parts TRL logs: NLL = -mean log-prob of chosen, logsigmoid(log odds), and the rewards beta * average
    assert output.nll_losses.tolist() == pytest.approx([-sum(c) / len(c) for c, _ in pairs], rel=1e-12)
    expected_log_odds = []
    for c, r in pairs:
        pw, pl = math.exp(sum(c) / len(c)), math.exp(sum(r) / len(r))
        expected_log_odds.append(math.log((pw / (1 - pw)) / (pl / (1 - pl))))
    assert output.log_odds.tolist() == pytest.approx(expected_log_odds, rel=1e-10)
    expected_ratios = [-math.log1p(math.exp(-x)) for x in expected_log_odds]
    assert output.log_odds_ratios.tolist() == pytest.approx(expected_ratios, rel=1e-10)
    assert output.rewards_chosen.tolist() == pytest.approx([lam * sum(c) / len(c) for c, _ in pairs], rel=1e-12)


def test_simpo_by_hand():
    # a_c = -1, a_r = -2, beta = 2, gamma = 1: z = 2 * 1 - 1 = 1, loss = log(1 + e^-1) = 0.31326169
    output = simpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=2.0, gamma=1.0)
    assert output.loss.item() == pytest.approx(0.31326169, abs=1e-6)
    assert output.reward_margin.item() == pytest.approx(2.0) and output.reward_accuracy.item() == 1.0


def test_orpo_is_float32_stable_near_probability_one():
    """An average log-prob of -1e-6 (P ~ 1 - 1e-6): log(1 - exp(a)) ~ log(1e-6), not the -inf of a rounded
    1 - exp(a) in float32."""
    values = torch.tensor([-1e-6, -0.5, -0.69, -0.7, -30.0], dtype=torch.float32)
    expected = [math.log(-math.expm1(v)) for v in values.double().tolist()]
    assert log1m_exp(values).tolist() == pytest.approx(expected, rel=1e-5)
    # At 0 (probability 1) the true value is -inf; the clamp at -1e-30 gives log(1e-30), finite, gradient 0
    at_zero = torch.tensor([0.0], requires_grad=True)
    value = log1m_exp(at_zero)
    value.backward()
    assert value.item() == pytest.approx(math.log(1e-30), rel=1e-5) and at_zero.grad.item() == 0.0
    chosen = torch.tensor([-1e-6, -0.3], requires_grad=True)
    output = orpo_loss(chosen, torch.tensor([-2.0, -0.3]), beta=0.1)
    output.loss.backward()
    assert torch.isfinite(output.loss) and torch.isfinite(chosen.grad).all()


@pytest.mark.parametrize("function, options", [(simpo_loss, {"gamma": 0.5}), (orpo_loss, {})])
def test_bad_arguments_are_refused(function, options):
    with pytest.raises(ValueError, match="beta must be > 0"):
        function(torch.tensor([-1.0]), torch.tensor([-1.0]), beta=0.0, **options)
    with pytest.raises(ValueError, match="one shape"):
        function(torch.tensor([-1.0]), torch.tensor([-1.0, -2.0]), beta=1.0, **options)
