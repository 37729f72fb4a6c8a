"""How every logged step metric is normalised: the one place that turns a step's global sums into means.

Each component hands the loop sums, never means (a mean of per-rank means would weight ranks, not
units): the strategies' losses and training statistics (`StepOutput.sums`), the rollout's generation and
rewards (`RolloutResult.metric_sums`, keys `rollout/...`) and online_ppo's frozen targets
(`Targets.metric_sums`, keys `targets/...`). The loop adds them over ranks in one collective and this
module divides each by its unit:

    offline      every training sum by `weight` (the step's loss units: tokens or pairs)
    online       losses (PER_LOSS_UNIT) by `weight` (tokens or responses: rl.loss_aggregation), every
                 other training sum (kl, clip_frac, approx_kl, entropy, ...) by the response tokens
    rollout/     by the responses (`rollout_metrics`: rewards, lengths, truncation, overlong penalty)
    targets/     by the response tokens the targets were pinned on (values, returns, advantages, kl) or,
                 for kl_coef, by the responses; explained variance from algos/
"""

from __future__ import annotations

from astrai.algos.ppo import explained_variance_from_sums

PER_LOSS_UNIT = ("loss", "policy_loss", "value_loss")  # online: per loss unit (`weight`); other training sums per token


def offline_record(totals: dict[str, float]) -> tuple[dict[str, float], float]:
    """Global sums of the offline step -> (metrics per loss unit, the step's attended tokens)."""
    totals = dict(totals)
    weight = max(totals.pop("weight", 1.0), 1.0)
    tokens = totals.pop("tokens")
    return {key: value / weight for key, value in totals.items()}, tokens


def online_record(totals: dict[str, float]) -> dict[str, float]:
    """Global sums of the online step (training, `rollout/` and `targets/` sums) -> its metrics."""
    training = {key: value for key, value in totals.items() if "/" not in key}
    weight, tokens = max(training.pop("weight", 1.0), 1.0), max(training.pop("tokens", 1.0), 1.0)
    record = {key: value / (weight if key in PER_LOSS_UNIT else tokens) for key, value in training.items()}
    record.update(rollout_metrics(totals))
    if "targets/tokens" in totals:
        record.update(target_metrics(totals))
    return record


def rollout_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Global sums of `RolloutResult.metric_sums` -> reward_mean, reward_std (population, over all
    responses of the step), reward_<component> means, response_len_mean (tokens, EOS included),
    truncated_frac, overlong_penalty (the mean rl.overlong_penalty added to the rewards)."""
    count = max(totals["rollout/responses"], 1.0)
    record = {
        "response_len_mean": totals["rollout/response_tokens"] / count,
        "truncated_frac": totals["rollout/truncated"] / count,
    }
    if "rollout/reward" in totals:
        mean = totals["rollout/reward"] / count
        record["reward_mean"] = mean
        record["reward_std"] = max(totals["rollout/reward_squared"] / count - mean**2, 0.0) ** 0.5
    for key, value in totals.items():
        if key.startswith("rollout/reward_") and key != "rollout/reward_squared":
            record[key.removeprefix("rollout/")] = value / count
    if "rollout/overlong_penalty" in totals:
        record["overlong_penalty"] = totals["rollout/overlong_penalty"] / count
    return record


def target_metrics(totals: dict[str, float]) -> dict[str, float]:
    """values_mean, returns_mean, advantages_mean/std (raw GAE advantages R - V, before whitening),
    explained_variance = 1 - Var[R - V] / Var[R] (0 when Var[R] is 0) and kl, per response token;
    kl_coef per response (the coefficient itself)."""
    tokens = max(totals["targets/tokens"], 1.0)
    advantages_mean = totals["targets/advantages"] / tokens
    advantages_var = max(totals["targets/advantages_squared"] / tokens - advantages_mean**2, 0.0)
    record = {
        "values_mean": totals["targets/values"] / tokens,
        "returns_mean": totals["targets/returns"] / tokens,
        "advantages_mean": advantages_mean,
        "advantages_std": advantages_var**0.5,
        "explained_variance": explained_variance_from_sums(
            totals["targets/tokens"],
            totals["targets/returns"],
            totals["targets/returns_squared"],
            totals["targets/advantages"],
            totals["targets/advantages_squared"],
        ),
    }
    if "targets/kl" in totals:
        record["kl"] = totals["targets/kl"] / tokens
    if "targets/kl_coef" in totals:
        record["kl_coef"] = totals["targets/kl_coef"] / max(totals["targets/responses"], 1.0)
    return record
