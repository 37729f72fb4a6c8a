"""KL estimators: values by hand, exact expectations over a small distribution, k3 >= 0."""

import math

import pytest
import torch

from astrai.algos.kl import kl_estimate, kl_k1, kl_k2, kl_k3


def test_values_by_hand():
    # pi(x) = 1/2, ref(x) = 1/4: log_ratio = log 2 = 0.69314718
    logp = torch.tensor([math.log(0.5)])
    logp_ref = torch.tensor([math.log(0.25)])
    assert kl_k1(logp, logp_ref).item() == pytest.approx(0.69314718)
    assert kl_k2(logp, logp_ref).item() == pytest.approx(0.5 * 0.69314718**2)  # 0.24022651
    # k3 = r - 1 - log r with r = ref/pi = 1/2: 0.5 - 1 + 0.69314718 = 0.19314718
    assert kl_k3(logp, logp_ref).item() == pytest.approx(0.19314718)
    # the other way round: r = 2, k3 = 2 - 1 - log 2 = 0.30685282, k1 = -log 2
    assert kl_k3(logp_ref, logp).item() == pytest.approx(0.30685282)
    assert kl_k1(logp_ref, logp).item() == pytest.approx(-0.69314718)


def test_equal_log_probs_give_zero():
    logp = torch.randn(3, 4)
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(logp, logp.clone(), kind), torch.zeros(3, 4))


def test_k1_and_k3_are_unbiased_exactly():
    """E_{x~pi}[k] = sum_x pi(x) k(x) must equal KL(pi || ref) = sum_x pi(x) log(pi(x)/ref(x))."""
    pi = [0.5, 0.3, 0.15, 0.05]
    ref = [0.1, 0.2, 0.3, 0.4]
    true_kl = sum(p * math.log(p / q) for p, q in zip(pi, ref))
    logp = torch.tensor(pi, dtype=torch.float64).log()
    logp_ref = torch.tensor(ref, dtype=torch.float64).log()
    weights = torch.tensor(pi, dtype=torch.float64)
    assert (weights * kl_k1(logp, logp_ref)).sum().item() == pytest.approx(true_kl, rel=1e-12)
    assert (weights * kl_k3(logp, logp_ref)).sum().item() == pytest.approx(true_kl, rel=1e-12)
    assert (weights * kl_k2(logp, logp_ref)).sum().item() != pytest.approx(true_kl, rel=1e-3)  # biased


def test_k3_is_never_negative():
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 50, generator=generator) * 5
    logp_ref = torch.randn(64, 50, generator=generator) * 5
    tiny = torch.full((3,), -1e-7)  # expm1 keeps precision near 0
    assert (kl_k3(logp, logp_ref) >= 0).all()
    assert (kl_k3(tiny, torch.zeros(3)) >= 0).all()
    assert (kl_k2(logp, logp_ref) >= 0).all()


def test_clamp_keeps_k3_finite_and_documents_its_bias():
    logp = torch.tensor([-200.0, 0.0])
    logp_ref = torch.tensor([0.0, 0.0])
    assert torch.isinf(kl_k3(logp, logp_ref)[0])  # exp(200) overflows float32
    clamped = kl_k3(logp, logp_ref, max_log_ratio=10.0)
    assert clamped[0].item() == pytest.approx(math.exp(10.0) - 10.0 - 1.0, rel=1e-6)
    assert clamped[1].item() == 0.0
    assert kl_k1(logp, logp_ref, max_log_ratio=10.0)[0].item() == -10.0
    with pytest.raises(ValueError, match="max_log_ratio must be > 0"):
        kl_k1(logp, logp_ref, max_log_ratio=0.0)


def test_dispatcher():
    logp, logp_ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    assert torch.equal(kl_estimate(logp, logp_ref, "k1"), kl_k1(logp, logp_ref))
    assert torch.equal(kl_estimate(logp, logp_ref, "k2"), kl_k2(logp, logp_ref))
    assert torch.equal(kl_estimate(logp, logp_ref), kl_k3(logp, logp_ref))
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(logp, logp_ref, "k4")


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log ratio 0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item() - 1 + 0.5)
