"""The few collectives a checkpoint save needs, with a bounded wait and the stalled phase named.

Two implementations of one small interface (`rank`, `world_size`, `exchange`):
- `LocalGroup`: one process, no torch.distributed calls at all.
- `DistributedGroup`: a dedicated gloo group. Each `exchange` is a monitored barrier (gloo only;
  on rank 0 it names the ranks that did not arrive) then an all_gather_object, both bounded by
  the group timeout, so a dead or hung rank turns into a CheckpointError naming the phase
  instead of a hang. After such a failure the group is unusable (gloo state is undefined).

torch is imported only when the caller already did: a process that never imported torch cannot
have initialized torch.distributed, and the verify CLI and the crash tests start much faster.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from .errors import CheckpointError


class PhaseStalledError(CheckpointError):
    """A collective did not complete: a rank died, hung, or took longer than the timeout."""


class LocalGroup:
    """Single-process stand-in: every exchange returns just this process's value."""

    rank = 0
    world_size = 1

    def exchange(self, phase: str, value: Any, context: str) -> list[Any]:
        return [value]


class DistributedGroup:
    """A gloo process group with a timeout; `exchange` gathers one picklable value per rank."""

    def __init__(self, distributed, group, timeout_s: float):
        self._distributed = distributed
        self._group = group
        self.timeout_s = timeout_s
        self.rank = distributed.get_rank(group)
        self.world_size = distributed.get_world_size(group)

    def exchange(self, phase: str, value: Any, context: str) -> list[Any]:
        """All ranks' `value`s, indexed by rank; PhaseStalledError if any rank fails to arrive in time."""
        try:
            self._distributed.monitored_barrier(
                group=self._group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
            gathered: list[Any] = [None] * self.world_size
            self._distributed.all_gather_object(gathered, value, group=self._group)
        except Exception as error:
            raise PhaseStalledError(
                f"{context}: phase '{phase}' did not complete within {self.timeout_s:g} s; a rank died or hung "
                f"(seen from rank {self.rank}: {type(error).__name__}: {error})"
            ) from error
        return gathered


def _loaded_distributed():
    """torch.distributed if torch is already imported by this process, else None (see module doc)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as distributed

    return distributed if distributed.is_available() else None


def open_group(group: Any, timeout_s: float) -> LocalGroup | DistributedGroup:
    """The exchange group for checkpoint saves.

    `group` None: single-process mode when torch.distributed is not initialized, otherwise a new
    gloo group over all ranks (a collective call: every rank must get here together).
    A given group must use the gloo backend (monitored_barrier and cheap object gathers).
    """
    distributed = _loaded_distributed()
    if group is None:
        if distributed is None or not distributed.is_initialized():
            return LocalGroup()
        group = distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    elif distributed is None:
        raise CheckpointError("a checkpoint process group was given but torch.distributed is not available")
    backend = distributed.get_backend(group)
    if str(backend).lower() != "gloo":
        raise CheckpointError(
            f"the checkpoint process group must use the gloo backend, got {backend!r}: "
            "create it with torch.distributed.new_group(backend='gloo', timeout=...) or pass group=None"
        )
    return DistributedGroup(distributed, group, timeout_s)
