"""DAPO's dynamic sampling (`rl.dynamic_sampling`, `grpo` only): a step trains on prompts_per_step groups
whose rewards are not all equal, sampling more prompts until it has them.

One step, on every rank together (W ranks, each drawing prompts_per_step / W prompts a round):

    round k     each rank samples and scores its prompts; the per-group "informative" flags of every rank
                are gathered (one small all-gather), so all ranks see the same flags and stop together:
                after the round that brings the informative groups to prompts_per_step, or after
                rl.max_sampling_rounds rounds
    pick        the step's groups, in sampling order (round, rank, group): the first prompts_per_step
                informative ones; the surplus of the last round is dropped
    fill        rounds exhausted with fewer: the step is filled with the uninformative groups in the same
                order. Their advantages are exactly 0, so only the informative groups move the policy, and
                the step keeps its shape (whole minibatches on every rank, the LR schedule's optimizer steps).
                verl raises instead (max_num_gen_batches); a run should not stop because a batch was easy.
    deal        step group g goes to rank g // (prompts_per_step / W): every rank gets whole groups, the
                same count as without dynamic sampling. Groups that change rank travel in one all-gather of
                the picked groups (skipped when every rank keeps exactly its own).

Every choice follows the sampled rewards, and sampling is seeded per (train.seed, step, rank, round): the
kept groups are the same in every run of the job, and a resume continues at the saved data position,
which counts every prompt drawn (rounds x prompts_per_step per step).

Metrics: sampling_rounds, kept_groups (informative groups trained on), dropped_groups (sampled, not trained
on), sampled_reward_mean (every response of every round; reward_mean is over the trained groups only).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from astrai.algos.dapo import informative_groups
from astrai.engine import all_gather_objects
from astrai.rollout import RolloutResult
from astrai.rollout.groups import concatenate_rollouts, select_groups

logger = logging.getLogger("astrai.online")


@dataclass
class StepSample:
    """What the sampling stage of one step hands the loop."""

    rollout: RolloutResult  # this rank's groups of the step, scored
    prompts_drawn: int  # prompts this step took from the data order, all rounds and ranks
    metrics: dict[str, float] = field(default_factory=dict)  # already global (the same on every rank)


def plan_groups(informative: list[list[list[bool]]], wanted: int) -> list[tuple[int, int, int]]:
    """informative[round][rank][group] -> the step's `wanted` groups as (round, rank, group), in sampling
    order: the informative ones first, then (only when there are too few) the uninformative ones."""
    order = [
        (round_index, rank, group, flag)
        for round_index, ranks in enumerate(informative)
        for rank, flags in enumerate(ranks)
        for group, flag in enumerate(flags)
    ]
    picked = [entry[:3] for entry in order if entry[3]][:wanted]
    if len(picked) < wanted:
        picked += [entry[:3] for entry in order if not entry[3]][: wanted - len(picked)]
    return picked


def deal_groups(
    rollouts: list[RolloutResult],
    picks: list[tuple[int, int, int]],
    *,
    rank: int,
    per_rank: int,
    pad_token_id: int,
    device="cpu",
) -> RolloutResult:
    """This rank's share of the step: picks[rank * per_rank : (rank + 1) * per_rank], whichever rank sampled
        them, on `device`. rollouts: this rank's rollout of each round. Collective: every rank must call it with the
    same picks (the groups that change rank travel on the CPU)."""
    own = range(rank * per_rank, (rank + 1) * per_rank)
    if all(picks[position][1] == position // per_rank for position in range(len(picks))):  # nothing changes rank
        parts = [select_groups(rollouts[picks[position][0]], [picks[position][2]], device) for position in own]
        return concatenate_rollouts(parts, pad_token_id)
    sent = []  # (positions, groups) of this rank's picked groups, one entry per round
    for round_index, rollout in enumerate(rollouts):
        positions = [position for position, (r, sender, _) in enumerate(picks) if r == round_index and sender == rank]
        if positions:
            sent.append((positions, select_groups(rollout, [picks[position][2] for position in positions])))
    received = {}
    for entries in all_gather_objects(sent):
        for positions, part in entries:
            for offset, position in enumerate(positions):
                if position in own:
                    received[position] = select_groups(part, [offset], device)
    return concatenate_rollouts([received[position] for position in own], pad_token_id)


def sample_dynamically(
    strategy, policy, prompt_batches: Iterator[list[dict]], *, step: int, policy_version: int
) -> StepSample:
    """Rounds of sampling until the step holds prompts_per_step informative groups (module docstring)."""
    job, dist = strategy.job, strategy.dist
    wanted, group_size = job.rollout.prompts_per_step, job.rollout.group_size
    rollouts, informative, reward_sum = [], [], 0.0
    for round_index in range(job.rl.max_sampling_rounds):
        rollout = strategy.rollout(
            policy, next(prompt_batches), step=step, policy_version=policy_version, sampling_round=round_index
        )
        strategy.score(rollout)
        rollouts.append(rollout)
        flags = informative_groups(rollout.rewards, group_size).tolist()
        gathered = all_gather_objects((flags, float(rollout.rewards.double().sum())))
        informative.append([rank_flags for rank_flags, _ in gathered])
        reward_sum += sum(rank_sum for _, rank_sum in gathered)
        if sum(sum(flags) for ranks in informative for flags in ranks) >= wanted:
            break
    picks = plan_groups(informative, wanted)
    kept = sum(informative[round_index][rank][group] for round_index, rank, group in picks)
    rounds = len(rollouts)
    if kept < wanted and dist.is_main:
        logger.warning(
            "step %d: %d informative groups of %d after rl.max_sampling_rounds %d; "
            "%d groups of equal rewards (advantages 0) fill the step",
            step,
            kept,
            wanted,
            rounds,
            wanted - kept,
        )
    rollout = deal_groups(
        rollouts,
        picks,
        rank=dist.rank,
        per_rank=strategy.geometry.prompts_per_rank,
        pad_token_id=strategy.tokenizer.pad_token_id,
        device=dist.device,
    )
    metrics = {
        "sampling_rounds": float(rounds),
        "kept_groups": float(kept),
        "dropped_groups": float(rounds * wanted - wanted),
        "sampled_reward_mean": reward_sum / (rounds * wanted * group_size),
    }
    return StepSample(rollout, rounds * wanted, metrics)
