"""Metrics: `output_dir/metrics.jsonl` (one object per logged optimizer step), trackers, progress bar.

Only rank 0 writes. The JSONL file is flushed and fsynced before every checkpoint publish, and on
resume trimmed to the records at or below the resumed step, so the log and the checkpoints agree.
The experiment trackers (TensorBoard, W&B, MLflow: `runtime.trackers`) get the same records through
astrai/observability/trackers/runs.py, which also says what a resume does to each.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from astrai.errors import AstraiError
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


class MetricsError(AstraiError, ValueError):
    """A metrics.jsonl line that is not a record; the message names the file and the line."""


def read_metrics(path: Path, skip_torn_last: bool = False) -> list[dict]:
    """The records of a metrics.jsonl. A line that is not a JSON object with a numeric `step` is a MetricsError
    naming file:line, except, with `skip_torn_last`, the last line: a run killed while writing it leaves it
    torn (as `trim_metrics` expects on resume), so it is skipped with one warning naming file:line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not _is_step(record.get("step")):
                raise ValueError("not a record with a numeric `step`")
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            reason = f"{error.msg} (column {error.colno})" if isinstance(error, json.JSONDecodeError) else str(error)
            if skip_torn_last and number == last:
                logger.warning(
                    "%s:%d: skipped the damaged last line (a run stopped writing it?): %s", path, number, reason
                )
                break
            raise MetricsError(f"{path}:{number}: damaged metrics line: {reason}") from None
        records.append(record)
    return records


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MetricsLog:
    def __init__(
        self,
        output_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int,
        progress_bar: bool,
        job=None,
        tensorboard: bool = False,
    ):
        """`job`: its `runtime.trackers` start (rank 0); without a job, `tensorboard` alone selects TensorBoard."""
        self.is_main = is_main
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._trackers = None
        self._bar = None
        self._last_eval: dict[str, float] = {}
        if not is_main:
            return
        self._file = open(self.path, "a")
        from astrai.observability.trackers.runs import Trackers, tensorboard_job

        self._trackers = Trackers(job or tensorboard_job(tensorboard), Path(output_dir), start_step)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, record: dict) -> None:
        if not self.is_main:
            return
        record = {"step": step, **{k: _plain(v) for k, v in record.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._trackers is not None:
            self._trackers.log(step, record)
        if self._bar is not None:
            self._last_eval.update({k: v for k, v in record.items() if k.startswith("eval/") and isinstance(v, float)})
            shown = {k: f"{record[k]:.4g}" for k in ("loss", "lr") if isinstance(record.get(k), float)}
            shown.update({k: f"{v:.4g}" for k, v in list(self._last_eval.items())[:1]})  # the last eval's first figure
            self._bar.set_postfix(shown, refresh=False)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def flush(self) -> None:
        """Make every record so far durable (called before each checkpoint publish)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._trackers is not None:
            self._trackers.flush()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None
        if self._trackers is not None:
            # Called from the loops' `finally`: an exception on its way out marks the tracker runs failed.
            self._trackers.finish(failed=sys.exc_info()[0] is not None)
            self._trackers = None
        if self._bar is not None:
            self._bar.close()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return value
