"""TensorBoard: event files under `<output_dir>/tensorboard/`."""

from __future__ import annotations

from pathlib import Path

from astrai.observability.trackers.base import Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    # purge_step: a reader drops the events at or past the resumed step, so the steps an interrupted run
    # logged after its last checkpoint are replaced by the resumed run's values, as in metrics.jsonl.
    replaces_steps = True

    def start(self, job, output_dir: Path, start_step: int, saved: dict | None) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, failed: bool) -> None:
        self._writer.close()
