"""PPO clipped losses (Schulman et al. 2017) for the policy and the critic, and the entropy bonus.

Policy, per valid token, with ratio = exp(logp - logp_old) and advantage A:

    loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))

Departures from the paper, all opt-in:
- `clip_eps_high` (DAPO's "clip-higher", Yu et al. 2025): a wider upper bound than lower one, so
  low-probability tokens with positive advantage can still grow. Defaults to `clip_eps`.
- `dual_clip` (Ye et al. 2020): for A < 0 the loss is further capped at -A * dual_clip (> 1), so a
  huge ratio on a bad token cannot produce an unbounded update.
- `max_log_ratio` (on by default, 20 as verl): log(pi / pi_old) is clamped to [-c, c] before exp. In
  float32 a log-ratio past ~88 makes the ratio inf and the gradient NaN even where the loss is finite
  (inf * 0 in the clip's backward); a clamped token has zero gradient and is counted in
  `log_ratio_clamp_fraction`.
- `importance_sampling="sequence"` (GSPO, Zheng et al. 2025, eqs. 5-7 and 13): one ratio per sequence,
  s_i = exp(mean_t log(pi / pi_old)) (the length-normalised log-ratio), clipped per sequence; written
  token-wise as s_i,t = sg[s_i] * pi_t / sg[pi_t] (GSPO-token), whose value is s_i and whose gradient
  is s_i * grad log pi_t, so that a per-sequence mean over tokens gives GSPO's gradient
  s_i A_i (1/|y_i|) sum_t grad log pi_t exactly (as verl's `compute_policy_loss_gspo`). Token
  advantages that vary along a sequence (GAE) are allowed: that is GSPO-token's extension.
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

from astrai.algos.logprobs import row_blocks
from astrai.algos.masked import masked_aggregate, masked_mean, masked_var


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # fraction of valid tokens whose loss comes from a clipped branch
    approx_kl: torch.Tensor  # token mean of (ratio - 1) - log(ratio): k3 estimate of KL(old || new)
    ratio_mean: torch.Tensor  # token mean of the ratio
    log_ratio_clamp_fraction: torch.Tensor  # fraction of valid tokens whose log-ratio hit +-max_log_ratio


class ValueLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: torch.Tensor  # fraction of valid tokens where the clipped error is the larger
    explained_variance: torch.Tensor  # 1 - Var[R - V] / Var[R] of the current values


def _zero_padding(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


IMPORTANCE_SAMPLING = ("token", "sequence")


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
    global_sequence_count: torch.Tensor | float | int | None = None,
    max_log_ratio: float | None = 20.0,
    importance_sampling: str = "token",
) -> PolicyLossOutput:
    """Clipped surrogate policy loss; formula in the module docstring.

    logp: [batch, response_len] log-probs of the sampled tokens under the policy being trained;
    logp_old: the same under the policy that sampled them (no gradient); advantages, mask:
    [batch, response_len]. clip_eps in (0, 1); clip_eps_high > 0 (defaults to clip_eps);
    dual_clip > 1 or None; max_log_ratio > 0 or None (no clamp).
    importance_sampling "token" (PPO) | "sequence" (GSPO: one length-normalised ratio per row).
    aggregation "token_mean" | "sequence_mean" | "global" | "global_sequence": with "global" the
    masked sum is divided by `global_token_count`, the number of valid tokens across all ranks and
    micro-batches of the optimizer step, with "global_sequence" the sum of per-row token means by
    `global_sequence_count` (rows with a token), so that gradient accumulation and data parallelism
    give the same gradient as one big batch (see `masked.masked_aggregate`).
    """
    _check_policy_arguments(clip_eps, clip_eps_high, dual_clip, max_log_ratio, importance_sampling)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if not (logp.shape == logp_old.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"logp, logp_old, advantages, mask must share one shape, got {tuple(logp.shape)}, "
            f"{tuple(logp_old.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    token_log_ratio = _zero_padding(logp - logp_old.detach(), valid)
    advantages = _zero_padding(advantages.detach(), valid)
    if importance_sampling == "sequence":
        log_ratio, clamped = _sequence_log_ratio(logp, token_log_ratio, valid, max_log_ratio)
    else:
        log_ratio, clamped = _clamped(token_log_ratio, max_log_ratio)
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

    loss = masked_aggregate(losses, valid, aggregation, global_token_count, global_sequence_count=global_sequence_count)
    with torch.no_grad():
        clip_fraction = masked_mean(from_clipped_branch.float(), valid)
        token_ratio = torch.exp(token_log_ratio.clamp(max=_EXP_SAFE))
        approx_kl = masked_mean(token_ratio - 1.0 - token_log_ratio, valid)
        ratio_mean = masked_mean(ratio, valid)
        clamp_fraction = masked_mean(clamped.float(), valid)
    return PolicyLossOutput(loss, clip_fraction, approx_kl, ratio_mean, clamp_fraction)


_EXP_SAFE = 80.0  # exp(80) ~ 5.5e34 is finite in float32: the diagnostics never turn inf


def _check_policy_arguments(clip_eps, clip_eps_high, dual_clip, max_log_ratio, importance_sampling) -> None:
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if clip_eps_high is not None and not clip_eps_high > 0.0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if max_log_ratio is not None and not max_log_ratio > 0.0:
        raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
    if importance_sampling not in IMPORTANCE_SAMPLING:
        raise ValueError(f"importance_sampling must be one of {IMPORTANCE_SAMPLING}, got {importance_sampling!r}")


def _clamped(log_ratio: torch.Tensor, max_log_ratio: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_ratio clamped to [-c, c], where the clamp binds); clamp's gradient is 0 where it binds."""
    if max_log_ratio is None:
        return log_ratio, torch.zeros_like(log_ratio, dtype=torch.bool)
    return log_ratio.clamp(-max_log_ratio, max_log_ratio), log_ratio.detach().abs() > max_log_ratio


def _sequence_log_ratio(
    logp: torch.Tensor, token_log_ratio: torch.Tensor, valid: torch.Tensor, max_log_ratio: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token's log s_i,t = sg[mean_t log(pi / pi_old)] + log pi_t - sg[log pi_t], [batch, response_len].

    Where the sequence's mean log-ratio passes +-max_log_ratio the clamped value is used, without
    gradient, for every token of that sequence (marked in the second tensor, [batch, response_len])."""
    sequence_log_ratio = masked_mean(token_log_ratio.detach(), valid, dim=-1)  # [batch]; 0 for an empty row
    clamped_sequence, binding = _clamped(sequence_log_ratio, max_log_ratio)
    logp = _zero_padding(logp, valid)
    pathwise = logp - logp.detach() + sequence_log_ratio.unsqueeze(1)
    log_ratio = torch.where(binding.unsqueeze(1), clamped_sequence.unsqueeze(1).expand_as(logp), pathwise)
    return _zero_padding(log_ratio, valid), binding.unsqueeze(1) & valid


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


def explained_variance_from_sums(
    count: float, returns: float, returns_squared: float, residuals: float, residuals_squared: float
) -> float:
    """`explained_variance` from sums over the valid entries (of every rank, added before this is called):
    count, sum R, sum R^2, sum (R - V), sum (R - V)^2. Population variances, 0 when Var[R] is 0."""
    count = max(count, 1.0)
    returns_var = max(returns_squared / count - (returns / count) ** 2, 0.0)
    residual_var = max(residuals_squared / count - (residuals / count) ** 2, 0.0)
    return 1.0 - residual_var / returns_var if returns_var > 0 else 0.0


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None = None,
    aggregation: str = "token_mean",
    global_token_count: torch.Tensor | float | int | None = None,
    global_sequence_count: torch.Tensor | float | int | None = None,
) -> ValueLossOutput:
    """Clipped critic loss; formula in the module docstring (without `clip_range`: 0.5 * (V - R)^2).

    values: [batch, response_len] critic outputs being trained; old_values: the critic's outputs at
    rollout time; returns: the targets (e.g. from `advantages.gae`); mask: [batch, response_len].
    aggregation, global_token_count and global_sequence_count: as in `ppo_policy_loss`.
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
    loss = masked_aggregate(losses, valid, aggregation, global_token_count, global_sequence_count=global_sequence_count)
    return ValueLossOutput(loss, clip_fraction, explained_variance(values.detach(), returns, valid))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution: H_t = logsumexp(l_t) - sum_v softmax(l_t)_v * l_t,v.

    logits: [batch, seq_len, vocab] (any float dtype). Returns [batch, seq_len] in float32
    (float64 for float64 logits), differentiable. A block of sequences at a time, like
    `logprobs.token_logprobs` (`row_blocks`), to bound the float32 working memory. Logits of -inf
    (masked vocabulary entries) are allowed: they have probability 0 and add nothing.
    """
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    rows = []
    for block_logits in logits.split(row_blocks(logits)):
        block_logits = block_logits.to(dtype)
        probabilities = torch.softmax(block_logits, dim=-1)
        # p * l is 0 * -inf = NaN for masked entries, in the forward and in the gradient alike.
        finite_logits = block_logits.masked_fill(~torch.isfinite(block_logits), 0.0)
        rows.append(torch.logsumexp(block_logits, dim=-1) - (probabilities * finite_logits).sum(dim=-1))
    if not rows:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def broadcast_sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give each sequence's advantage to each of its valid tokens (GRPO).

    advantages: [batch]; mask: [batch, response_len]. Returns [batch, response_len], 0 at padding.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expected advantages [batch] and mask [batch, response_len], got {tuple(advantages.shape)}, "
            f"{tuple(mask.shape)}"
        )
    return _zero_padding(advantages.unsqueeze(1).expand(mask.shape), mask.bool())
