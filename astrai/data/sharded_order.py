"""Deterministic global sample order and each rank's share of it.

The whole run is one stream of samples: epoch e is a permutation of the data set seeded by
(seed, e); global micro-step k takes positions [k*M*W, (k+1)*M*W) of it and rank r takes its
M-sample slice. The only state is `consumed_samples` (global), so a resume, even on another world
size, continues exactly where the stream stopped: no sample is seen twice or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ShardedOrder:
    def __init__(
        self, num_samples: int, micro_batch_size: int, world_size: int, rank: int, seed: int, shuffle: bool = True
    ):
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.samples_per_micro_step = micro_batch_size * world_size
        # Each epoch uses whole global micro-steps; the remainder (< M*W samples) waits for the next epoch's shuffle.
        self.samples_per_epoch = (num_samples // self.samples_per_micro_step) * self.samples_per_micro_step
        if self.samples_per_epoch == 0:
            raise ValueError(
                f"the data set has {num_samples} samples, fewer than one global micro-batch "
                f"(micro_batch_size {micro_batch_size} x world size {world_size})"
            )

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def epoch_of(self, consumed_samples: int) -> int:
        return consumed_samples // self.samples_per_epoch

    def micro_batches(self, consumed_samples: int = 0) -> Iterator[list[int]]:
        """This rank's sample indices for every global micro-step from `consumed_samples` on, forever."""
        if consumed_samples % self.samples_per_micro_step:
            raise ValueError(
                f"consumed_samples {consumed_samples} is not a multiple of the global micro-batch "
                f"{self.samples_per_micro_step}"
            )
        epoch, position = divmod(consumed_samples, self.samples_per_epoch)
        while True:
            order = self.epoch_order(epoch)
            for start in range(position, self.samples_per_epoch, self.samples_per_micro_step):
                own = start + self.rank * self.micro_batch_size
                yield order[own : own + self.micro_batch_size]
            epoch, position = epoch + 1, 0

    def steps(self, consumed_samples: int = 0, accumulation: int = 1) -> Iterator[tuple[list[list[int]], int]]:
        """This rank's `accumulation` micro-batches of every step from `consumed_samples` on, and the samples
        (all ranks) each step consumes: the loop's view, shared with data.packing's TokenBalancedOrder."""
        batches = self.micro_batches(consumed_samples)
        while True:
            yield [next(batches) for _ in range(accumulation)], self.samples_per_micro_step * accumulation
