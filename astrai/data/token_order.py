"""`data.packing`'s sampler: the same deterministic global order, cut into steps by tokens instead of rows.

The run is still one stream of rows: epoch e is the permutation of the data set seeded by (seed, e), the
epochs follow each other, and the only state is `consumed_samples`, the global position in that stream. A
step takes the next rows of the stream, in order, into W x A micro-batches (W ranks, A = grad_accum_steps)
of at most `train.micro_batch_tokens` tokens each: every row goes to the micro-batch with the fewest tokens
so far, and the step ends at the first row that fits in none (it opens the next step). Then the micro-batches,
sorted by tokens, are dealt out so that accumulation step a of every rank gets one of W neighbours in that
order: all ranks run A micro-batches (DeepSpeed's accumulation boundary stays where it is) and at every one
of them wait on a micro-batch of about the same size. A row is never split; a row over the budget is refused
before training, named. Because a step is a function of its start position only, a resume at
`consumed_samples`, on any world size, lands on the same next row.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import torch

from astrai.data.packing import PackingError
from astrai.data.sharded_order import ShardedOrder


def row_lengths(dataset) -> list[int]:
    """Tokens of each row of a rendered data set: input_ids (sft), or chosen + rejected (a dpo pair)."""
    if "input_ids" in dataset.column_names:
        return [len(ids) for ids in dataset["input_ids"]]
    return [len(c) + len(r) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"])]


class TokenBalancedOrder:
    samples_per_micro_step = 1  # any stream position is a place to continue from (checkpointing rounds to it)

    def __init__(
        self,
        lengths: list[int],
        token_budget: int,
        world_size: int,
        rank: int,
        accumulation: int,
        seed: int,
        shuffle: bool = True,
    ):
        for index, length in enumerate(lengths):
            if length > token_budget:
                raise PackingError(
                    f"data row {index} has {length} tokens, more than train.micro_batch_tokens {token_budget}: "
                    "raise train.micro_batch_tokens (a row is never split) or lower data.max_seq_len"
                )
        if not lengths:
            raise PackingError("data.packing: the data set has no rows")
        self.lengths, self.token_budget = lengths, token_budget
        self.world_size, self.rank, self.accumulation = world_size, rank, accumulation
        self.seed, self.shuffle = seed, shuffle
        self.num_samples = self.samples_per_epoch = len(lengths)
        self._orders: dict[int, list[int]] = {}

    def epoch_order(self, epoch: int) -> list[int]:
        """The same permutation as ShardedOrder's for (seed, epoch)."""
        if not self.shuffle:
            return list(range(self.num_samples))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.num_samples, generator=generator).tolist()}
        return self._orders[epoch]

    def epoch_of(self, consumed_samples: int) -> int:
        return consumed_samples // self.num_samples

    def row_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        return self.epoch_order(epoch)[offset]

    def global_step(self, consumed_samples: int) -> tuple[list[list[int]], int]:
        """The W x A micro-batches of the step starting at stream position `consumed_samples`, in dealing
        order (accumulation step a, rank r at a x W + r), and the number of rows they take."""
        bins = self.world_size * self.accumulation
        rows: list[list[int]] = [[] for _ in range(bins)]
        heap = [(0, b) for b in range(bins)]  # (tokens, micro-batch): the emptiest first, ties by index
        position = consumed_samples
        while True:
            index = self.row_at(position)
            tokens, b = heap[0]
            if tokens + self.lengths[index] > self.token_budget:
                break  # fits in no micro-batch: it opens the next step (every micro-batch holds a row by now)
            heapq.heapreplace(heap, (tokens + self.lengths[index], b))
            rows[b].append(index)
            position += 1
        loads = {b: tokens for tokens, b in heap}
        dealt = sorted(range(bins), key=lambda b: (-loads[b], b))
        return [rows[b] for b in dealt], position - consumed_samples

    def steps(
        self, consumed_samples: int = 0, accumulation: int | None = None
    ) -> Iterator[tuple[list[list[int]], int]]:
        """This rank's A micro-batches (row indices) of every step from `consumed_samples` on, and the rows
        (all ranks) each step consumed. (`accumulation`: ShardedOrder's argument, fixed here at construction.)"""
        while True:
            dealt, taken = self.global_step(consumed_samples)
            own = [dealt[a * self.world_size + self.rank] for a in range(self.accumulation)]
            yield own, taken
            consumed_samples += taken

    def steps_for_epochs(self, epochs: float) -> int:
        """Steps until `epochs` passes over the rows are consumed (train.epochs with packing)."""
        target, consumed, steps = epochs * self.num_samples, 0, 0
        while consumed < target:
            consumed += self.global_step(consumed)[1]
            steps += 1
        return max(1, steps)


def make_order(job, dataset, dist, rows_per_draw: int):
    """data.packing: the token-balanced order; otherwise the row order (ShardedOrder), `rows_per_draw` rows per
    rank per draw (`Strategy.rows_per_draw`). The ranks are the data-parallel ones: the ranks of a
    sequence-parallel group draw the same rows (each cuts every sequence of them)."""
    train = job.train
    if job.data.packing:
        return TokenBalancedOrder(
            row_lengths(dataset),
            train.micro_batch_tokens,
            dist.data_parallel_size,
            dist.data_parallel_rank,
            train.grad_accum_steps,
            train.seed,
            job.data.shuffle,
        )
    return ShardedOrder(
        len(dataset), rows_per_draw, dist.data_parallel_size, dist.data_parallel_rank, train.seed, job.data.shuffle
    )
