"""Metrics: `output_dir/metrics.jsonl` (one object per logged optimizer step), TensorBoard, progress bar.

Only rank 0 writes. The JSONL file is flushed and fsynced before every checkpoint publish, and on
resume trimmed to the records at or below the resumed step, so the log and the checkpoints agree.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from astrai.safe_write import write_file_atomic

logger = logging.getLogger("astrai.metrics")

METRICS_FILE = "metrics.jsonl"


def trim_metrics(path: Path, last_step: int) -> int:
    """Keep the records with `step <= last_step` (atomically); returns how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash
            dropped += 1
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line)
        else:
            dropped += 1
    write_file_atomic(path, "".join(line + "\n" for line in kept))
    return dropped


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsLog:
    def __init__(
        self,
        output_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int,
        tensorboard: bool,
        progress_bar: bool,
    ):
        self.is_main = is_main
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._board = None
        self._bar = None
        if not is_main:
            return
        self._file = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._board = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                logger.info("tensorboard not installed; metrics go to %s only", self.path)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, record: dict) -> None:
        if not self.is_main:
            return
        record = {"step": step, **{k: _plain(v) for k, v in record.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._board.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.set_postfix(
                {k: f"{record[k]:.4g}" for k in ("loss", "lr") if isinstance(record.get(k), float)}, refresh=False
            )

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def flush(self) -> None:
        """Make every record so far durable (called before each checkpoint publish)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._board is not None:
            self._board.flush()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
        if self._bar is not None:
            self._bar.close()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return value
