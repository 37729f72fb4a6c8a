"""PPO policy and value losses: clipping by hand, aggregation invariance under autograd, metrics."""

import math

import pytest
import torch

from astrai.algos.ppo import (
    broadcast_sequence_advantages,
    entropy_from_logits,
    explained_variance,
    ppo_policy_loss,
    value_loss,
)


def one_row(ratios, advantages, requires_grad=True):
    """logp (a leaf) and logp_old = 0 such that exp(logp - logp_old) is the given ratio."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=requires_grad)
    return logp, torch.zeros_like(logp), torch.tensor([advantages], dtype=torch.float64), torch.ones(1, len(ratios))


def test_policy_clipping_cases_by_hand():
    # eps = 0.2, clip range [0.8, 1.2]; per token: max(-A r, -A clip(r))
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2  clipped   d/dlogp = 0
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5            d/dlogp = -A r = -0.5
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5            d/dlogp = -A r = 1.5
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  clipped   d/dlogp = 0
    #   A=+2, r=1.1: max(-2.2, -2.2) = -2.2            d/dlogp = -2.2
    logp, logp_old, advantages, mask = one_row([1.5, 0.5, 1.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0])
    output = ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2)
    assert output.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)  # -0.32
    assert output.clip_fraction.item() == pytest.approx(2 / 5)
    assert output.ratio_mean.item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)  # 1.02
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.5, 0.5, 1.1)]
    assert output.approx_kl.item() == pytest.approx(sum(k3) / 5)
    output.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 5, 1.5 / 5, 0.0, -2.2 / 5])
    assert not output.clip_fraction.requires_grad and not output.approx_kl.requires_grad


def test_clip_higher_widens_the_upper_bound_only():
    # A=+1: r=1.25 is inside [0.8, 1.28]; r=1.5 is clipped to 1.28. A=-1, r=0.5: lower bound 0.8 still binds.
    logp, logp_old, advantages, mask = one_row([1.25, 1.5, 0.5], [1.0, 1.0, -1.0])
    output = ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert output.loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert output.clip_fraction.item() == pytest.approx(2 / 3)
    symmetric = ppo_policy_loss(*one_row([1.25], [1.0]), clip_eps=0.2)
    assert symmetric.loss.item() == pytest.approx(-1.2) and symmetric.clip_fraction.item() == 1.0


def test_dual_clip_caps_negative_advantages():
    # dual_clip = 3:  A=-1, r=4: max(4, 1.2) = 4 > 3 -> 3 (clipped, no gradient)
    #                 A=-1, r=2: 2 <= 3 -> 2 (gradient -A r = 2)
    #                 A=+1, r=4: -1.2, unaffected (clipped by the ordinary bound)
    logp, logp_old, advantages, mask = one_row([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0])
    output = ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2, dual_clip=3.0)
    assert output.loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert output.clip_fraction.item() == pytest.approx(2 / 3)
    output.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, 0.0])
    without = ppo_policy_loss(*one_row([4.0], [-1.0]), clip_eps=0.2)
    assert without.loss.item() == pytest.approx(4.0)


def test_sequence_mean_weighs_sequences_equally():
    # ratios 1 (logp = logp_old): per-token loss = -A
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logp = torch.zeros(2, 3)
    token_mean = ppo_policy_loss(logp, logp, advantages, mask, clip_eps=0.2)
    sequence_mean = ppo_policy_loss(logp, logp, advantages, mask, clip_eps=0.2, aggregation="sequence_mean")
    assert token_mean.loss.item() == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    assert sequence_mean.loss.item() == pytest.approx(-((1 + 2 + 3) / 3 + 4) / 2)


def random_batch(seed, batch=6, length=7):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    tensors = [torch.randn(batch, length, generator=generator, dtype=torch.float64) for _ in range(3)]
    return mask, tensors


def test_global_aggregation_makes_micro_batches_sum_to_the_full_batch_gradient():
    mask, (logp_values, logp_old, advantages) = random_batch(0)
    logp_old = logp_values + 0.3 * logp_old  # ratios on both sides of the clip range
    total_tokens = mask.sum()

    full = logp_values.clone().requires_grad_(True)
    ppo_policy_loss(full, logp_old, advantages, mask, clip_eps=0.2).loss.backward()

    splits = (slice(0, 1), slice(1, 6))  # two micro-batches of unequal token counts
    assert mask[splits[0]].sum() != mask[splits[1]].sum()
    parts = logp_values.clone().requires_grad_(True)
    summed_loss = 0.0
    for rows in splits:
        loss = ppo_policy_loss(
            parts[rows],
            logp_old[rows],
            advantages[rows],
            mask[rows],
            clip_eps=0.2,
            aggregation="global",
            global_token_count=total_tokens,
        ).loss
        loss.backward()
        summed_loss += loss.item()
    assert torch.allclose(parts.grad, full.grad)
    assert summed_loss == pytest.approx(ppo_policy_loss(full, logp_old, advantages, mask, clip_eps=0.2).loss.item())

    # the check has teeth: averaging per-micro-batch token means does not give the same gradient
    naive = logp_values.clone().requires_grad_(True)
    for rows in splits:
        (ppo_policy_loss(naive[rows], logp_old[rows], advantages[rows], mask[rows], clip_eps=0.2).loss / 2).backward()
    assert not torch.allclose(naive.grad, full.grad)


def test_global_aggregation_invariance_for_the_value_loss():
    mask, (values_data, old_values, returns) = random_batch(1)
    full = values_data.clone().requires_grad_(True)
    value_loss(full, old_values, returns, mask, clip_range=0.5).loss.backward()
    parts = values_data.clone().requires_grad_(True)
    for rows in (slice(0, 1), slice(1, 6)):
        value_loss(
            parts[rows],
            old_values[rows],
            returns[rows],
            mask[rows],
            clip_range=0.5,
            aggregation="global",
            global_token_count=int(mask.sum()),
        ).loss.backward()
    assert torch.allclose(parts.grad, full.grad)


def test_junk_in_padding_does_not_reach_loss_or_gradient():
    logp = torch.tensor([[-1.0, -2.0, 50.0]], requires_grad=True)
    logp_old = torch.tensor([[-1.1, -1.9, float("nan")]])
    advantages = torch.tensor([[1.0, -1.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    output = ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2)
    output.loss.backward()
    assert torch.isfinite(output.loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 2].item() == 0.0
    values = torch.tensor([[1.0, 2.0, 1e30]], requires_grad=True)
    value_output = value_loss(
        values, torch.tensor([[1.0, 2.0, float("nan")]]), torch.tensor([[0.0, 0.0, float("nan")]]), mask
    )
    value_output.loss.backward()
    assert value_output.loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    assert torch.isfinite(values.grad).all() and values.grad[0, 2].item() == 0.0


def test_value_loss_by_hand():
    # clip_range 0.2:
    #   V=1.5, V_old=1, R=2: (1.5-2)^2 = 0.25; clipped V = 1.2, (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32  clipped
    #   V=1.5, V_old=1, R=1: (1.5-1)^2 = 0.25; clipped V = 1.2, (1.2-1)^2 = 0.04 -> 0.5 * 0.25 = 0.125
    values = torch.tensor([[1.5, 1.5]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2)
    output = value_loss(values, old_values, returns, mask, clip_range=0.2)
    assert output.loss.item() == pytest.approx((0.32 + 0.125) / 2)
    assert output.clip_fraction.item() == 0.5
    output.loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 / 2])  # clipped: no gradient; else (V - R) / 2
    unclipped = value_loss(values, old_values, returns, mask)
    assert unclipped.loss.item() == pytest.approx(0.125) and unclipped.clip_fraction.item() == 0.0
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        value_loss(values, old_values, returns, mask, clip_range=0.0)


def test_explained_variance_by_hand():
    targets = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # residuals 0, 0, -1, 1: Var = 0.5; Var[targets] = 1.25 -> 1 - 0.5 / 1.25 = 0.6
    assert explained_variance(torch.tensor([[1.0, 2.0, 4.0, 3.0, -5.0]]), targets, mask).item() == pytest.approx(0.6)
    assert explained_variance(targets, targets, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 5), 2.5), targets, mask).item() == pytest.approx(0.0)
    assert explained_variance(torch.zeros(1, 5), torch.ones(1, 5), mask).item() == 0.0  # Var[targets] = 0
    output = value_loss(torch.tensor([[1.0, 2.0, 4.0, 3.0, 0.0]]), torch.zeros(1, 5), targets, mask)
    assert output.explained_variance.item() == pytest.approx(0.6)


def test_entropy_against_plain_python():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=generator) * 3
    expected = []
    for row in logits.tolist():
        expected_row = []
        for token_logits in row:
            normaliser = sum(math.exp(x) for x in token_logits)
            probabilities = [math.exp(x) / normaliser for x in token_logits]
            expected_row.append(-sum(p * math.log(p) for p in probabilities))
        expected.append(expected_row)
    assert torch.allclose(entropy_from_logits(logits), torch.tensor(expected), atol=1e-5)
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))  # uniform
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32
    tiny = logits[:, :2, :4].double().requires_grad_(True)
    assert torch.autograd.gradcheck(entropy_from_logits, (tiny,))


def test_entropy_with_masked_vocabulary_is_finite():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(math.log(2))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_broadcast_sequence_advantages():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert broadcast_sequence_advantages(torch.tensor([0.5, -2.0]), mask).tolist() == [
        [0.5, 0.5, 0.0],
        [-2.0, 0.0, 0.0],
    ]
    with pytest.raises(ValueError, match="expected advantages"):
        broadcast_sequence_advantages(torch.tensor([0.5]), mask)


def test_policy_loss_rejects_bad_arguments():
    logp, logp_old, advantages, mask = one_row([1.0], [1.0])
    with pytest.raises(ValueError, match="clip_eps must be in"):
        ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=1.5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        ppo_policy_loss(logp, logp_old, advantages, mask, clip_eps=0.2, aggregation="sum")
    with pytest.raises(ValueError, match="share one shape"):
        ppo_policy_loss(logp, logp_old, advantages, torch.ones(1, 2), clip_eps=0.2)


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


# ----------------------------------------------------------------------------- log-ratio clamp (issue #23, item 3)


def test_a_huge_log_ratio_gives_a_finite_gradient_and_is_counted():
    """Behaviour -95, current -5, A = 1 in float32: unclamped, exp(90) is inf and the gradient NaN from a
    finite loss; clamped at 20 (the default) the token is clipped, its gradient 0, and it is counted."""

    def run(max_log_ratio):
        logp = torch.tensor([[-5.0, -1.0]], requires_grad=True)
        output = ppo_policy_loss(
            logp,
            torch.tensor([[-95.0, -1.0]]),
            torch.ones(1, 2),
            torch.ones(1, 2),
            clip_eps=0.2,
            max_log_ratio=max_log_ratio,
        )
        output.loss.backward()
        return output, logp.grad

    unclamped, unclamped_gradient = run(None)
    assert math.isfinite(unclamped.loss.item()) and math.isnan(unclamped_gradient[0, 0].item())  # the defect
    clamped, gradient = run(20.0)
    assert torch.isfinite(gradient).all() and gradient[0, 0].item() == 0.0
    assert gradient[0, 1].item() == pytest.approx(-0.5)
    assert clamped.loss.item() == pytest.approx((-1.2 - 1.0) / 2)  # the clipped branch 1 + eps, and ratio 1
    assert clamped.log_ratio_clamp_fraction.item() == 0.5 and clamped.clip_fraction.item() == 0.5
    assert math.isfinite(clamped.approx_kl.item())
    with pytest.raises(ValueError, match="max_log_ratio must be > 0"):
        ppo_policy_loss(*one_row([1.0], [1.0]), clip_eps=0.2, max_log_ratio=0.0)


# ----------------------------------------------------------------------------- GSPO (issue #23, item 9)


def gspo_loop(logp, logp_old, advantages, lengths, clip_low, clip_high, weights):
    """GSPO eqs. 5-7 row by row: s_i = exp(mean_t (logp - logp_old)), l_i = max(-A_i s_i, -A_i clip(s_i)),
    loss = sum_i weights[i] * l_i (A_i: the row's first advantage; sequence advantages)."""
    total = 0.0
    for row, length in enumerate(lengths):
        if not length:
            continue
        log_ratio = sum(logp[row, t] - logp_old[row, t] for t in range(length)) / length
        ratio = torch.exp(log_ratio)
        advantage = advantages[row, 0]
        clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        total = total + weights[row] * torch.maximum(-advantage * ratio, -advantage * clipped_ratio)
    return total


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_sequence_importance_sampling_against_the_paper(aggregation):
    """Loss and gradient of importance_sampling="sequence" equal GSPO's sequence objective computed per
    row in float64 (ragged rows, an empty row, rows clipped on either side). With sequence_mean every row
    weighs 1 / rows (GSPO); with token_mean its length / tokens (the same per-row objective, length-weighted)."""
    generator = torch.Generator().manual_seed(4)
    lengths = [4, 2, 0, 5, 1, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths], dtype=torch.float64)
    logp_old = -torch.rand(6, 5, generator=generator, dtype=torch.float64) * 3
    shift = torch.tensor([0.3, -0.4, 0.0, 0.05, 1.0, -0.02], dtype=torch.float64).unsqueeze(1)  # in/out of range
    logp = (logp_old + shift + 0.1 * torch.randn(6, 5, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, 2.0, -1.0, -0.5, 0.7], dtype=torch.float64).unsqueeze(1).expand(6, 5) * mask
    rows, tokens = sum(1 for n in lengths if n), sum(lengths)
    weights = [1.0 / rows if aggregation == "sequence_mean" else n / tokens for n in lengths]
    expected = gspo_loop(logp, logp_old, advantages, lengths, 0.2, 0.28, weights)
    output = ppo_policy_loss(
        logp,
        logp_old,
        advantages,
        mask,
        clip_eps=0.2,
        clip_eps_high=0.28,
        aggregation=aggregation,
        importance_sampling="sequence",
    )
    assert output.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    (loop_gradient,) = torch.autograd.grad(expected, logp)
    (gradient,) = torch.autograd.grad(output.loss, logp)
    assert torch.allclose(gradient, loop_gradient, atol=1e-12) and gradient.abs().sum() > 0
    sequence_ratio = {
        r: math.exp(sum((logp[r, t] - logp_old[r, t]).item() for t in range(n)) / n) for r, n in enumerate(lengths) if n
    }
    clipped_rows = [
        r
        for r, ratio in sequence_ratio.items()
        if (advantages[r, 0] > 0 and ratio > 1.28) or (advantages[r, 0] < 0 and ratio < 0.8)
    ]
    clipped_tokens = sum(lengths[r] for r in clipped_rows)
    assert output.clip_fraction.item() == pytest.approx(clipped_tokens / tokens) and 0 < clipped_tokens < tokens
    assert min(sequence_ratio.values()) < 0.8 and max(sequence_ratio.values()) > 1.28  # both sides exercised


def test_sequence_importance_sampling_clamps_the_sequence_log_ratio():
    logp = torch.tensor([[-5.0, -5.0], [-1.0, -1.0]], requires_grad=True)
    logp_old = torch.tensor([[-95.0, -95.0], [-1.0, -1.0]])
    ones = torch.ones(2, 2)
    output = ppo_policy_loss(logp, logp_old, ones, ones, clip_eps=0.2, importance_sampling="sequence")
    output.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0].abs().sum() == 0
    assert output.log_ratio_clamp_fraction.item() == 0.5
    with pytest.raises(ValueError, match="importance_sampling must be one of"):
        ppo_policy_loss(logp, logp_old, torch.ones(2, 2), torch.ones(2, 2), clip_eps=0.2, importance_sampling="row")
