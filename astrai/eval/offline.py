"""Eval of the offline train types (`seq`, `sft`, `dpo`, and any strategy of the offline loop): the strategy's
`eval_sums` over every held-out example, sharded over the ranks, summed over all of them in one collective, and
turned into figures by `eval_metrics` (seq/sft: token-mean loss and perplexity; dpo: loss, reward accuracy,
margin).

Rank r takes examples r, r + W, ... in micro-batches of `train.micro_batch_size`; every rank runs the same
number of forwards (a ZeRO-3 forward is a collective), a rank short of examples repeating one and dropping its
sums. The figures are therefore those of the whole eval set whatever the world size (up to the order of the
float sums).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from astrai.engine import all_reduce_sums
from astrai.eval.data import rank_share


def _to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def offline_eval_sums(run) -> dict[str, float]:
    """This rank's sums of `strategy.eval_sums` over its share of `run.eval_dataset` (call under no_grad)."""
    strategy, policy, dataset = run.strategy, run.engines["policy"], run.eval_dataset
    micro = run.job.train.micro_batch_size
    # The ranks of a sequence-parallel group share their examples: each forward is the group's.
    own, per_rank = rank_share(len(dataset), run.dist.data_parallel_rank, run.dist.data_parallel_size)
    sums: dict[str, float] = defaultdict(float)
    for start in range(0, per_rank, micro):
        indices = own[start : start + micro]
        padding = not indices
        batch = strategy.collate([dataset[index] for index in (indices or [0])])
        output = strategy.eval_sums(policy, _to_device(batch, run.dist.device))
        for key, value in output.items():  # a padding batch adds its keys (every rank sends the same) but 0
            sums[key] += 0.0 if padding else float(value)
    return sums


def evaluate_offline(run) -> dict[str, float]:
    """The eval figures of the current weights, the same on every rank (names without `eval/`)."""
    sums = offline_eval_sums(run)
    names = sorted(set(sums) | {"weight"})  # every rank sends the same keys: a rank may have had no example
    totals = dict(zip(names, all_reduce_sums([sums.get(name, 0.0) for name in names], run.dist.device)))
    group = run.dist.sequence_parallel_size  # each rank of a sequence-parallel group summed the same examples
    totals = {name: value / group for name, value in totals.items()}
    return run.strategy.eval_metrics(totals)
