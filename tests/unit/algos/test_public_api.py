"""The public names of astrai.algos that other tools call by keyword: compute_gae, kl_estimate,
explained_variance (a renamed parameter breaks those callers)."""

from __future__ import annotations

import pytest
import torch


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
