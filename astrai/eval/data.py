"""The eval examples of a job: `eval.data_path` prepared like the training data, or `eval.holdout` examples
held out of the prepared training data.

The holdout is chosen from the prepared examples (packed blocks for `seq`, rendered chats, pairs or prompts
otherwise) by a permutation seeded with `train.seed` alone, in a generator of its own: every rank prepares the
same examples in the same order, so every rank, and every resume of the run, holds out the same ones, and the
training RNG is not touched. The held-out examples are removed from the training data before its order is built.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import datasets
import torch

from astrai.config import ConfigError
from astrai.data.sources import load_rows
from astrai.engine import barrier

logger = logging.getLogger("astrai.eval")

HOLDOUT_STREAM = 0x5EED_E7A1  # mixed into train.seed: the holdout's permutation is not any other draw of the run


def holdout_count(holdout: float | int, size: int) -> int:
    """Examples held out of `size`: a fraction rounds to the nearest count (at least 1); a count is itself."""
    count = max(1, round(holdout * size)) if isinstance(holdout, float) else int(holdout)
    if count >= size:
        raise ConfigError(
            f"eval.holdout {holdout} holds out {count} of the {size} prepared training examples, leaving none "
            "to train on: use a smaller holdout or eval.data_path"
        )
    return count


def split_holdout(
    dataset: datasets.Dataset, holdout: float | int, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(training examples, held-out examples): a seeded choice of `holdout_count` examples, each part in the
    original order."""
    count = holdout_count(holdout, len(dataset))
    generator = torch.Generator().manual_seed((seed * 1_000_003 + HOLDOUT_STREAM) % (2**63 - 1))
    chosen = torch.randperm(len(dataset), generator=generator)[:count]
    held = torch.zeros(len(dataset), dtype=torch.bool)
    held[chosen] = True
    keep = (~held).nonzero().flatten().tolist()
    return dataset.select(keep), dataset.select(held.nonzero().flatten().tolist())


def prepare_eval_file(job, strategy, output_dir: Path, is_main: bool) -> datasets.Dataset:
    """`eval.data_path` prepared by the strategy, rank 0 first (the others read its cache)."""
    skip_bad = job.data.on_bad_row == "skip"
    rows = load_rows(job.eval.data_path, job.eval.format, output_dir / "cache" / "datasets", skip_bad=skip_bad)
    if is_main:
        dataset, skipped = strategy.prepare_data(rows)
    barrier()
    if not is_main:
        dataset, skipped = strategy.prepare_data(rows)
    if skipped:
        logger.warning("eval.data_path: skipped %d malformed rows (data.on_bad_row: skip)", skipped)
    return dataset


def split_eval_data(job, strategy, dataset: datasets.Dataset, output_dir: Path, is_main: bool):
    """(training dataset, eval dataset or None) for `job.eval`; `eval.max_samples` keeps the first examples."""
    settings = job.eval
    if settings is None:
        return dataset, None
    if settings.holdout is not None:
        dataset, examples = split_holdout(dataset, settings.holdout, job.train.seed)
    else:
        examples = prepare_eval_file(job, strategy, output_dir, is_main)
    if len(examples) == 0:
        raise ConfigError(f"eval.data_path {settings.data_path}: no eval examples after preparation")
    if settings.max_samples is not None and settings.max_samples < len(examples):
        examples = examples.select(range(settings.max_samples))
    logger.info("eval: %d examples, %d training examples", len(examples), len(dataset))
    return dataset, examples


def rank_share(size: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """Rank `rank`'s example indices (rank, rank + W, ...) and the count every rank iterates over
    (ceil(size / W)): ranks with fewer run padding forwards whose results they drop, because a ZeRO-3
    forward (and a ZeRO-3 generation copy) is a collective that every rank must join."""
    return list(range(rank, size, world_size)), math.ceil(size / world_size)
