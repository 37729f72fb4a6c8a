"""The one owner of a run's data position (`DataStream`): the data order and the global count drawn.

Below the strategies and the loops on purpose: `Run` (astrai/training/run_parts.py) holds one, the loops
draw from it and checkpointing saves its position.
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets

from astrai.data.sharded_order import ShardedOrder
from astrai.data.token_order import TokenBalancedOrder


class DataStream:
    """The run's one data order and the position in it: the global count of samples drawn (every rank's).

    Offline a draw is one micro-batch per rank (train.micro_batch_size rows); online it is one step's
    prompts per rank (`Strategy.rows_per_draw`). Drawing advances the position, so the position a
    checkpoint saves (`state_dict`) is exactly what was drawn, and `load_state_dict` puts the next draw on
    the first sample not yet seen, whichever loop reads it."""

    def __init__(self, dataset: datasets.Dataset, order: ShardedOrder | TokenBalancedOrder):
        self.dataset = dataset
        self.order = order
        self.consumed_samples = 0

    @property
    def samples_per_draw(self) -> int:
        """Global samples one draw takes (rows per rank x world size): the unit a position is aligned to."""
        return self.order.samples_per_micro_step

    @property
    def epoch(self) -> int:
        return self.order.epoch_of(self.consumed_samples)

    def batches(self) -> Iterator[list[dict]]:
        """This rank's rows of each draw from the current position on, forever; each draw moves the position
        past every rank's share of it."""
        for indices in self.order.micro_batches(self.consumed_samples):
            self.consumed_samples += self.samples_per_draw
            yield [self.dataset[index] for index in indices]

    def steps(self, accumulation: int) -> Iterator[list[list[dict]]]:
        """The offline loop's draws: this rank's rows of each step's `accumulation` micro-batches from the
        current position on (with data.packing cut by tokens, `TokenBalancedOrder`); each step moves the
        position past every rank's rows of it."""
        for micro_batches, taken in self.order.steps(self.consumed_samples, accumulation):
            self.consumed_samples += taken
            yield [[self.dataset[index] for index in micro] for micro in micro_batches]

    def state_dict(self) -> dict[str, int]:
        """The position as trainer_state.json records it (`consumed_samples`, and the `epoch` it falls in)."""
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state["consumed_samples"]` (already aligned to `samples_per_draw` by the resume)."""
        self.consumed_samples = int(state["consumed_samples"])
