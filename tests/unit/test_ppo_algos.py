"""online_ppo's math against hand-computed numbers and plain loops: GAE (public `compute_gae`), k3 reward
shaping, the clipped surrogate with dual-clip, value clipping, explained variance (per batch and from
the step's global sums), and the all-rank whitening."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from astrai.algos import (
    compute_gae,
    explained_variance,
    global_standardize,
    kl_estimate,
    kl_shaped_rewards,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)
from astrai.step_metrics import target_metrics


def reverse_loop_gae(rewards, values, lengths, gamma, lam):
    """GAE one row and one token at a time, backwards, in Python floats (terminal after the last valid token)."""
    advantages, returns = [], []
    for row_rewards, row_values, length in zip(rewards, values, lengths):
        row_advantages, next_advantage = [0.0] * len(row_rewards), 0.0
        for t in reversed(range(length)):
            next_value = row_values[t + 1] if t + 1 < length else 0.0
            next_advantage = row_rewards[t] + gamma * next_value - row_values[t] + gamma * lam * next_advantage
            row_advantages[t] = next_advantage
        advantages.append(row_advantages)
        returns.append([a + v if t < length else 0.0 for t, (a, v) in enumerate(zip(row_advantages, row_values))])
    return advantages, returns


def test_compute_gae_by_hand_with_padding():
    # gamma 0.9, lambda 0.5; row 0 has 3 valid tokens, row 1 has 1 and junk (NaN, 100) in its padding.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 100.0, 100.0]])
    values = torch.tensor([[0.5, 0.4, 0.2], [1.0, float("nan"), 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages, returns = compute_gae(rewards, values, mask, 0.9, 0.5)
    # row 0: d2 = 1 - 0.2 = 0.8; d1 = 0 + 0.9*0.2 - 0.4 = -0.22; d0 = 0 + 0.9*0.4 - 0.5 = -0.14
    #        A2 = 0.8; A1 = -0.22 + 0.45*0.8 = 0.14; A0 = -0.14 + 0.45*0.14 = -0.077
    # row 1: A0 = 2 - 1 = 1 (terminal: V after the last token is 0); padding 0
    assert torch.allclose(advantages, torch.tensor([[-0.077, 0.14, 0.8], [1.0, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.423, 0.54, 1.0], [2.0, 0.0, 0.0]]), atol=1e-6)


@pytest.mark.parametrize("gamma, lam", list(itertools.product([0.0, 1.0], [0.0, 1.0])) + [(0.99, 0.95)])
def test_compute_gae_matches_a_reverse_loop_with_padding(gamma, lam):
    rng = random.Random(int(gamma * 10 + lam))
    lengths = [0, 1, 4, 7, 7, 3]
    rewards = [[rng.gauss(0, 1) for _ in range(7)] for _ in lengths]
    values = [[rng.gauss(0, 1) for _ in range(7)] for _ in lengths]
    mask = torch.tensor([[1 if t < length else 0 for t in range(7)] for length in lengths])
    advantages, returns = compute_gae(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), mask, gamma, lam
    )
    expected_advantages, expected_returns = reverse_loop_gae(rewards, values, lengths, gamma, lam)
    assert torch.allclose(advantages, torch.tensor(expected_advantages, dtype=torch.float64))
    assert torch.allclose(returns, torch.tensor(expected_returns, dtype=torch.float64))


def test_compute_gae_edge_values_have_their_textbook_meaning():
    rewards, values = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 1.0, 2.0]])
    mask = torch.ones(1, 3)
    advantages, _ = compute_gae(rewards, values, mask, 0.0, 0.7)  # gamma 0: A_t = r_t - V_t
    assert advantages.tolist() == [[0.5, 1.0, 1.0]]
    advantages, _ = compute_gae(rewards, values, mask, 1.0, 0.0)  # lambda 0: one-step TD error
    assert advantages.tolist() == [[1.0 + 1.0 - 0.5, 2.0 + 2.0 - 1.0, 3.0 - 2.0]]
    _, returns = compute_gae(rewards, values, mask, 1.0, 1.0)  # gamma = lambda = 1: reward-to-go, whatever V
    assert returns.tolist() == [[6.0, 5.0, 3.0]]


def test_k3_shaping_puts_kl_on_every_token_and_the_reward_on_the_last_real_one():
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ref_logp = torch.tensor([[-1.5, -1.0, -0.5, 7.0], [-0.1, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    kl = kl_estimate(logp, ref_logp, "k3")
    rewards = kl_shaped_rewards(torch.tensor([1.0, -2.0, 5.0]), kl, mask, 0.1)
    k3 = lambda log_ratio: torch.expm1(torch.tensor(-log_ratio)).item() + log_ratio  # (r - 1) - log r, r = ref / pi
    expected = [
        [-0.1 * k3(0.5), -0.1 * k3(-1.0), -0.1 * k3(0.0) + 1.0, 0.0],  # the reward on token 2, the last real one
        [-0.1 * k3(-0.2) - 2.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],  # no valid token: no reward at all
    ]
    assert torch.allclose(rewards, torch.tensor(expected), atol=1e-6)
    assert (kl[mask.bool()] >= 0).all() and rewards[0, 0] < 0 and rewards[0, 1] < 0  # a KL cost on every real token


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log ratio 0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item() - 1 + 0.5)


def test_clipped_surrogate_by_hand_with_asymmetric_and_dual_clip():
    # ratios 1.5, 0.5, 1.1, 5.0; advantages +1, +1, -1, -1; eps_low 0.2, eps_high 0.3, dual clip c = 3
    logp_old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    output = ppo_policy_loss(
        logp, logp_old, advantages, torch.ones(1, 4), clip_eps=0.2, clip_eps_high=0.3, dual_clip=3.0
    )
    # token 0: max(-1.5, -1.3) = -1.3 (clipped at 1.3); token 1: max(-0.5, -0.8) = -0.5 (unclipped)
    # token 2: max(1.1, 1.1) = 1.1; token 3: max(5, 1.3) = 5, capped by dual clip at -A c = 3
    assert output.loss.item() == pytest.approx((-1.3 - 0.5 + 1.1 + 3.0) / 4, abs=1e-6)
    assert output.clip_fraction.item() == pytest.approx(0.5)  # tokens 0 and 3
    without_dual = ppo_policy_loss(logp, logp_old, advantages, torch.ones(1, 4), clip_eps=0.2, clip_eps_high=0.3)
    assert without_dual.loss.item() == pytest.approx((-1.3 - 0.5 + 1.1 + 5.0) / 4, abs=1e-6)


def test_value_clipping_by_hand():
    old = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, -0.1, 1.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    output = value_loss(values, old, returns, torch.ones(1, 3), clip_range=0.2)
    # token 0: (0.5-1)^2 = 0.25, clipped V = 0.2: (0.2-1)^2 = 0.64 -> 0.64 (clipped branch, no gradient)
    # token 1: (-0.1-1)^2 = 1.21, clipped V = -0.1 -> 1.21; token 2: 1 and 1 -> 1
    assert output.loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 1.0) / 3, abs=1e-6)
    assert output.clip_fraction.item() == pytest.approx(1 / 3)
    output.loss.backward()
    assert values.grad[0, 0].item() == 0.0 and values.grad[0, 1].item() == pytest.approx((-0.1 - 1.0) / 3)


def test_explained_variance_cases():
    mask = torch.tensor([[1, 1, 1, 0]])
    returns = torch.tensor([[1.0, -1.0, 0.0, 42.0]])  # centred over the valid tokens
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)  # perfect critic
    assert explained_variance(torch.zeros(1, 4), returns, mask).item() == pytest.approx(0.0)  # zero critic
    assert explained_variance(-returns, returns, mask).item() == pytest.approx(-3.0)  # worse than the mean
    assert explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask).item() == 0.0  # Var[R] = 0: defined as 0


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


def test_public_math_api_by_keyword_exactly_as_the_issue_names_it():
    """Other tools call these three by keyword; renaming a parameter breaks them, so this pins the names."""
    import inspect

    import astrai.algos

    mask = torch.tensor([[1, 1, 0]])
    rewards, values = torch.tensor([[0.0, 1.0, 9.0]]), torch.tensor([[0.5, 0.25, 9.0]])
    advantages, returns = astrai.algos.compute_gae(rewards=rewards, values=values, mask=mask, gamma=1.0, lam=1.0)
    # reward-to-go 1, 1 minus the values 0.5, 0.25; padding 0
    assert advantages.tolist() == [[0.5, 0.75, 0.0]] and returns.tolist() == [[1.0, 1.0, 0.0]]
    logp, ref_logp = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert astrai.algos.kl_estimate(logp=logp, ref_logp=ref_logp, kind="k1").item() == pytest.approx(0.5)
    assert astrai.algos.kl_estimate(logp=logp, ref_logp=ref_logp).item() == pytest.approx(
        torch.exp(torch.tensor(-0.5)).item() - 0.5
    )  # k3 default
    explained = astrai.algos.explained_variance(
        values=torch.tensor([[1.0, -1.0, 5.0]]), returns=torch.tensor([[1.0, -1.0, 0.0]]), mask=mask
    )
    assert isinstance(explained, torch.Tensor) and explained.item() == pytest.approx(1.0)
    assert list(inspect.signature(astrai.algos.compute_gae).parameters) == ["rewards", "values", "mask", "gamma", "lam"]
    assert list(inspect.signature(astrai.algos.kl_estimate).parameters)[:3] == ["logp", "ref_logp", "kind"]
    assert inspect.signature(astrai.algos.kl_estimate).parameters["kind"].default == "k3"
    assert list(inspect.signature(astrai.algos.explained_variance).parameters) == ["values", "returns", "mask"]


def test_global_standardize_on_one_rank_is_masked_whiten():
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(4, 6, generator=generator)
    mask = torch.rand(4, 6, generator=generator) > 0.4
    whitened = global_standardize(advantages, mask)
    assert torch.equal(global_standardize(advantages, mask, lambda sums: list(sums)), whitened)
    assert torch.allclose(whitened, masked_whiten(advantages, mask), atol=1e-6)
    assert (whitened[~mask] == 0).all()
