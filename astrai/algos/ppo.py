"""PPO clipped losses (Schulman et al. 2017) for the policy and the critic, and the entropy bonus.

Policy, per valid token, with ratio = exp(logp - logp_old) and advantage A:

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))

Departures from the paper, all opt-in:
- `clip_eps_high` (DAPO's "clip-higher", Yu et al. 2025): a wider upper bound than lower one, so
  low-probability tokens with positive advantage can still grow. Defaults to `clip_eps`.
- `dual_clip` (Ye et al. 2020): for A < 0 the loss is further capped at -A * dual_clip (> 1), so a
  huge ratio on a bad token cannot produce an unbounded update.
- `aggregation` chooses how token losses become one number (see `masked.masked_aggregate`); the
  paper's expectation over timesteps is "token_mean". GRPO (Shao et al. 2024) uses
  "sequence_mean"; Dr. GRPO and DAPO argue for token-level means ("token_mean" / "global").

GRPO's policy loss is this one, with each sequence's advantage given to all its tokens
(`broadcast_sequence_advantages`); its KL term (`kl.kl_k3`) is added by the caller.

Value, per valid token, with return R and the rollout's value V_old (PPO2's clipped critic):

    loss_t = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

Padded positions may hold junk: inputs are selected with `torch.where` before any arithmetic,
so neither the loss nor the gradient sees it. Metrics are detached token means of this batch.
"""

from typing import NamedTuple

import torch

from astrai.algos.masked import masked_aggregate, masked_mean, masked_var


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # fraction of valid tokens whose loss comes from a clipped branch
    approx_kl: torch.Tensor  # token mean of (ratio - 1) - log(ratio): k3 estimate of KL(old || new)
    ratio_mean: torch.Tensor  # token mean of the ratio


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # fraction of valid tokens where the clipped error is the larger
    explained_variance: torch.Tensor  # 1 - Var[R - V] / Var[R] of the current values


def _zero_padding(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def ppo_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    global_token_count: torch.Tensor | float | int | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate policy loss; formula in the module docstring.

    logp: [batch, response_len] log-probs of the sampled tokens under the policy being trained;
    logp_old: the same under the policy that sampled them (no gradient); advantages, mask:
    [batch, response_len]. clip_eps in (0, 1); clip_eps_high > 0 (defaults to clip_eps);
    dual_clip > 1 or None.
    aggregation "token_mean" | "sequence_mean" | "global": with "global" the masked sum is divided
    by `global_token_count`, the number of valid tokens across all ranks and micro-batches of the
    optimizer step, so that gradient accumulation and data parallelism give the same gradient as
    one big batch (the caller undoes its engine's averaging; see `masked.masked_aggregate`).
    """
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if not clip_eps_high > 0.0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if not (logp.shape == logp_old.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"logp, logp_old, advantages, mask must share one shape, got {tuple(logp.shape)}, "
            f"{tuple(logp_old.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    log_ratio = _zero_padding(logp - logp_old.detach(), valid)
    advantages = _zero_padding(advantages.detach(), valid)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps_high)
    losses = torch.maximum(unclipped, clipped)
    from_clipped_branch = clipped > unclipped
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (losses > dual_bound)
        losses = torch.where(dual_active, dual_bound, losses)
        from_clipped_branch = from_clipped_branch | dual_active

    loss = masked_aggregate(losses, valid, aggregation, global_token_count)
    with torch.no_grad():
        clip_fraction = masked_mean(from_clipped_branch.float(), valid)
        approx_kl = masked_mean(ratio - 1.0 - log_ratio, valid)
        ratio_mean = masked_mean(ratio, valid)
    return PolicyLossOutput(loss, clip_fraction, approx_kl, ratio_mean)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over valid entries (detached scalar).

    values (the critic's predictions), returns (its targets), mask: [batch, response_len]. 1 is a
    perfect critic, 0 is no better than the mean, < 0 is worse. Returns 0 when Var[returns] is 0
    (the ratio is undefined there).
    """
    with torch.no_grad():
        returns_var = masked_var(returns, mask, unbiased=False)
        residual_var = masked_var(returns - values, mask, unbiased=False)
        positive = returns_var > 0
        safe_returns_var = torch.where(positive, returns_var, torch.ones_like(returns_var))
        return torch.where(positive, 1.0 - residual_var / safe_returns_var, torch.zeros_like(returns_var))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = None,
    aggregation: str = "token_mean",
    global_token_count: torch.Tensor | float | int | None = None,
) -> ValueLossOutput:
    """Clipped critic loss; formula in the module docstring (without `clip_range`: 0.5 * (V - R)^2).

    values: [batch, response_len] critic outputs being trained; old_values: the critic's outputs at
    rollout time; returns: the targets (e.g. from `advantages.gae`); mask: [batch, response_len].
    aggregation and global_token_count: as in `ppo_policy_loss`.
    explained_variance is measured on `values` (the critic as it is now).
    """
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values, old_values, returns, mask must share one shape, got {tuple(values.shape)}, "
            f"{tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    values = _zero_padding(values, valid)
    old_values = _zero_padding(old_values.detach(), valid)
    returns = _zero_padding(returns.detach(), valid)
    squared_error = (values - returns) ** 2
    if clip_range is None:
        losses = 0.5 * squared_error
        clip_fraction = torch.zeros((), dtype=torch.float32, device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_squared_error = (clipped_values - returns) ** 2
        losses = 0.5 * torch.maximum(squared_error, clipped_squared_error)
        with torch.no_grad():
            clip_fraction = masked_mean((clipped_squared_error > squared_error).float(), valid)
    loss = masked_aggregate(losses, valid, aggregation, global_token_count)
    return ValueLossOutput(loss, clip_fraction, explained_variance(values.detach(), returns, valid))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution: H_t = logsumexp(l_t) - sum_v softmax(l_t)_v * l_t,v.

    logits: [batch, seq_len, vocab] (any float dtype). Returns [batch, seq_len] in float32
    (float64 for float64 logits), differentiable. One sequence at a time, like
    `logprobs.token_logprobs`, to bound the float32 working memory. Logits of -inf (masked
    vocabulary entries) are allowed: they have probability 0 and add nothing.
    """
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    rows = []
    for row_logits in logits:
        row_logits = row_logits.to(dtype)
        probabilities = torch.softmax(row_logits, dim=-1)
        # p * l is 0 * -inf = NaN for masked entries, in the forward and in the gradient alike.
        finite_logits = row_logits.masked_fill(~torch.isfinite(row_logits), 0.0)
        rows.append(torch.logsumexp(row_logits, dim=-1) - (probabilities * finite_logits).sum(dim=-1))
    if not rows:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    return torch.stack(rows)


def broadcast_sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give each sequence's advantage to each of its valid tokens (GRPO).

    advantages: [batch]; mask: [batch, response_len]. Returns [batch, response_len], 0 at padding.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"expected advantages [batch] and mask [batch, response_len], got {tuple(advantages.shape)}, {tuple(mask.shape)}")
    return _zero_padding(advantages.unsqueeze(1).expand(mask.shape), mask.bool())
