"""GRPO advantages, GAE, KL-shaped rewards and KL controllers: by hand and against plain loops."""

import itertools
import random

import pytest
import torch

from astrai.algos import compute_gae, kl_estimate
from astrai.algos.advantages import (
    AdaptiveKLController,
    FixedKLController,
    discounted_returns,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
    rloo_advantages,
)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735027 -> +-0.5 / 0.57735027 = +-0.8660254
    # group 2: all equal -> 0 (std 0, divided by eps only)
    advantages = grpo_advantages(rewards, group_size=4)
    assert advantages.tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0, 0, 0, 0], abs=1e-5)
    no_std = grpo_advantages(rewards, group_size=4, normalize_std=False)
    assert no_std.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_grpo_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="do not split"):
        grpo_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo_advantages(torch.zeros(6), group_size=1)
    with pytest.raises(ValueError, match="must be 1-D"):
        grpo_advantages(torch.zeros(2, 4), group_size=4)


def test_gae_with_gamma_and_lambda_one_gives_reward_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert returns.tolist() == [[6.0, 5.0, 3.0]]  # 1+2+3, 2+3, 3
    assert advantages.tolist() == [[5.5, 4.5, 2.5]]  # returns - values


def test_gae_by_hand_with_padding():
    # gamma = lam = 0.5, two valid tokens, junk in the padded third
    rewards = torch.tensor([[1.0, 2.0, 100.0]])
    values = torch.tensor([[1.0, 1.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # t=1: delta = 2 + 0.5 * 0 - 1 = 1                  A = 1
    # t=0: delta = 1 + 0.5 * 1 - 1 = 0.5                A = 0.5 + 0.25 * 1 = 0.75
    assert advantages.tolist() == [[0.75, 1.0, 0.0]]
    assert returns.tolist() == [[1.75, 2.0, 0.0]]


def loop_gae(rewards, values, lengths, gamma, lam):
    """Textbook GAE, one sequence and one step at a time, in Python floats."""
    all_advantages, all_returns = [], []
    for row_rewards, row_values, length in zip(rewards, values, lengths):
        advantages = [0.0] * len(row_rewards)
        for t in range(length):
            total = 0.0
            for k in range(t, length):
                next_value = row_values[k + 1] if k + 1 < length else 0.0
                delta = row_rewards[k] + gamma * next_value - row_values[k]
                total += (gamma * lam) ** (k - t) * delta
            advantages[t] = total
        all_advantages.append(advantages)
        all_returns.append([a + (v if t < length else 0.0) for t, (a, v) in enumerate(zip(advantages, row_values))])
    return all_advantages, all_returns


def test_gae_matches_plain_loop_on_random_data():
    rng = random.Random(0)
    batch, response_len = 6, 9
    lengths = [rng.randint(0, response_len) for _ in range(batch)] + [response_len]
    rewards = [[rng.gauss(0, 1) for _ in range(response_len)] for _ in lengths]
    values = [[rng.gauss(0, 1) for _ in range(response_len)] for _ in lengths]
    mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(response_len)] for length in lengths])
    gamma, lam = 0.97, 0.9
    advantages, returns = gae(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        mask,
        gamma=gamma,
        lam=lam,
    )
    expected_advantages, expected_returns = loop_gae(rewards, values, lengths, gamma, lam)
    assert torch.allclose(advantages, torch.tensor(expected_advantages, dtype=torch.float64))
    assert torch.allclose(returns, torch.tensor(expected_returns, dtype=torch.float64))


def test_gae_returns_targets_without_gradient():
    values = torch.randn(2, 4, requires_grad=True)
    advantages, returns = gae(torch.randn(2, 4), values, torch.ones(2, 4), gamma=1.0, lam=0.95)
    assert not advantages.requires_grad and not returns.requires_grad
    with pytest.raises(ValueError, match="share one"):
        gae(torch.randn(2, 4), values, torch.ones(2, 3), gamma=1.0, lam=0.95)


def test_kl_shaped_rewards_by_hand():
    sequence_rewards = torch.tensor([1.0, -2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    rewards = kl_shaped_rewards(sequence_rewards, kl, mask, kl_coef=0.5)
    expected = [
        [-0.05, -0.1, -0.15 + 1.0],  # -0.5 * kl, reward on the third (last) token
        [-0.2 - 2.0, 0.0, 0.0],  # one valid token: it is the last
        [0.0, 0.0, 0.0],  # no valid token: no reward
    ]
    assert rewards.tolist() == [pytest.approx(row) for row in expected]


def test_adaptive_kl_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    # error = clip(9/6 - 1 = 0.5, +-0.2) = 0.2; 0.2 * (1 + 0.2 * 256 / 10000) = 0.2 * 1.00512
    assert controller.update(9.0, n_steps=256) == pytest.approx(0.201024)
    # error = 5.4/6 - 1 = -0.1 (unclipped); * (1 - 0.1 * 1000 / 10000) = * 0.99
    controller.update(torch.tensor(5.4), n_steps=1000)
    assert controller.value == pytest.approx(0.19901376)
    # error = 0/6 - 1 = -1 -> -0.2; * (1 - 0.2 * 10000 / 10000) = * 0.8
    controller.update(0.0, n_steps=10000)
    assert controller.value == pytest.approx(0.159211008)
    restored = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="target and horizon must be > 0"):
        AdaptiveKLController(init_kl_coef=0.2, target=0.0, horizon=10000)


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    assert controller.update(123.0, n_steps=10**6) == 0.05
    assert controller.value == 0.05
    assert controller.state_dict() == {"value": 0.05}


def test_rloo_advantages_against_a_loop():
    """A_i = r_i - mean of the other responses of its group (RLOO; verl's compute_rloo_outcome_advantage)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, -1.0, 3.0, 0.0], dtype=torch.float64)
    group_size = 4
    expected = []
    for index, reward in enumerate(rewards.tolist()):
        start = index - index % group_size
        others = [rewards[j].item() for j in range(start, start + group_size) if j != index]
        expected.append(reward - sum(others) / len(others))
    assert rloo_advantages(rewards, group_size).tolist() == pytest.approx(expected, abs=1e-12)
    centred = grpo_advantages(rewards, group_size, normalize_std=False)
    assert torch.allclose(rloo_advantages(rewards, group_size), centred * group_size / (group_size - 1))
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rloo_advantages(rewards, 1)


def test_discounted_returns_against_a_loop():
    """G_t = r_t + gamma G_{t+1} within each row's valid prefix; 0 on padding; an empty row is all 0."""
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    lengths = [6, 3, 0, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    for gamma in (1.0, 0.9):
        returns = discounted_returns(rewards, mask, gamma=gamma)
        for row, length in enumerate(lengths):
            for t in range(6):
                expected = sum(gamma ** (s - t) * rewards[row, s].item() for s in range(t, length))  # 0 past the end
                assert returns[row, t].item() == pytest.approx(expected, abs=1e-12)


# ----------------------------------------------------------------------------- GAE and k3 shaping (online_ppo)


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

    def k3(log_ratio: float) -> float:  # (r - 1) - log r, r = ref / pi
        return torch.expm1(torch.tensor(-log_ratio)).item() + log_ratio

    expected = [
        [-0.1 * k3(0.5), -0.1 * k3(-1.0), -0.1 * k3(0.0) + 1.0, 0.0],  # the reward on token 2, the last real one
        [-0.1 * k3(-0.2) - 2.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],  # no valid token: no reward at all
    ]
    assert torch.allclose(rewards, torch.tensor(expected), atol=1e-6)
    assert (kl[mask.bool()] >= 0).all() and rewards[0, 0] < 0 and rewards[0, 1] < 0  # a KL cost on every real token
