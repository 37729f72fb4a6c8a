"""What one run is made of (`Run`): everything `build_run` makes for a job.

The strategies name `Run` in annotations only (`setup(run: Run)`, under TYPE_CHECKING), so this module may
sit in training/ beside the builder that makes it without the strategies importing the training package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from astrai.config import JobConfig
from astrai.data.stream import DataStream
from astrai.engine import DistInfo, Engine

if TYPE_CHECKING:  # the strategies name Run for annotations; at run time Run needs no Strategy
    from astrai.strategies.base import Strategy


@dataclass
class Run:
    """Everything `build_run` makes for one job; the strategy's `setup`, the loops and checkpointing read it."""

    job: JobConfig
    dist: DistInfo
    output_dir: Path
    tokenizer: object  # a transformers tokenizer (slow or fast)
    strategy: Strategy
    data: DataStream
    total_steps: int
    engines: dict[str, Engine]
    eval_dataset: datasets.Dataset | None = None  # eval.data_path or eval.holdout's examples (astrai/eval/)

    @property
    def dataset(self) -> datasets.Dataset:
        return self.data.dataset

    @dataset.setter
    def dataset(self, dataset: datasets.Dataset) -> None:  # dpo's precomputed reference log-probs replace it
        self.data.dataset = dataset

    @property
    def samples_per_step(self) -> int:
        return self.job.train.micro_batch_size * self.job.train.grad_accum_steps * self.dist.data_parallel_size
