"""What one online step's losses read, frozen at rollout time: the strategy's, not the rollout's.

The rollout (`astrai/rollout/`) knows generation and rewards only. `frozen_targets` turns it into a
`Targets`: per-sequence tensors by name ([N, ...]: the sequences, behaviour log-probs and what the
strategy adds, e.g. advantages), which the replay minibatches slice, plus whatever else the strategy
pins for the step (online_ppo's KL coefficient) and the metric sums it derives from them.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch


@dataclass
class Targets(MutableMapping):
    """Read like the mapping of tensors it holds (`targets["advantages"]`); never recomputed in replay."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __delitem__(self, key: str) -> None:
        del self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def metric_sums(self) -> dict[str, float]:
        """This rank's sums (keys `targets/...`) that `step_metrics` turns into the step's target metrics."""
        return {}
