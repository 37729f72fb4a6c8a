"""eval.holdout's choice: a count or a rounded fraction of the prepared examples, chosen by train.seed alone
(the same in every process that prepares the same examples), disjoint from the training part, order kept."""

from __future__ import annotations

import random

import datasets
import pytest

from astrai.config import ConfigError
from astrai.eval.data import holdout_count, rank_share, split_holdout


def examples(size: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"index": list(range(size))})


def test_counts_and_fractions():
    assert holdout_count(5, 100) == 5
    assert holdout_count(0.05, 100) == 5
    assert holdout_count(0.001, 100) == 1  # a fraction never holds out nothing
    assert holdout_count(0.126, 100) == 13
    with pytest.raises(ConfigError, match="eval.holdout 100 holds out 100 of the 100 prepared"):
        holdout_count(100, 100)


def test_the_split_is_seeded_disjoint_and_ordered():
    state = random.getstate()
    train, held = (list(part["index"]) for part in split_holdout(examples(50), 0.2, seed=7))
    assert random.getstate() == state  # no global RNG drawn
    assert len(held) == 10 and len(train) == 40
    assert sorted(train + held) == list(range(50))
    assert held == sorted(held) and train == sorted(train)
    again = list(split_holdout(examples(50), 0.2, seed=7)[1]["index"])
    assert again == held  # every rank, every resume
    other = list(split_holdout(examples(50), 0.2, seed=8)[1]["index"])
    assert other != held


def test_rank_shares_cover_the_set_once():
    shares = [rank_share(7, rank, 3) for rank in range(3)]
    assert [share for share, _ in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert {rounds for _, rounds in shares} == {3}  # every rank runs as many forwards as the largest share
