"""The trackers of one run, on rank 0: started together, fed every metrics record, a failure isolated.

`<output_dir>/trackers.json` keeps, per tracker, what reopens its run (`run_id`, MLflow's `tracking_uri`)
and `last_step`, the newest step it was sent. A resume from a checkpoint (start_step > 0) reopens the same
runs; a fresh start (no checkpoint, or `checkpoint.resume: never`) opens new ones.

Steps past the resumed checkpoint that the interrupted run had already logged: metrics.jsonl is trimmed
and gets the resumed run's records for them; TensorBoard purges them (its purge_step) and takes the
resumed values too; W&B and MLflow only append, so the resumed run does not send them a second time:
they keep the interrupted run's values for those steps, and take records again from `last_step + 1`.
(A resumed run retraces the same steps, so the two agree up to nondeterminism of the kernels.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from astrai.observability.trackers import TRACKERS, installed, selected_trackers
from astrai.observability.trackers.base import Tracker, numeric_metrics
from astrai.safe_write import write_file_atomic

logger = logging.getLogger("astrai.trackers")

STATE_FILE = "trackers.json"


def read_state(output_dir: Path) -> dict:
    path = Path(output_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as error:
        logger.warning("%s unreadable (%s): the trackers open new runs", path, error)
        return {}
    return state if isinstance(state, dict) else {}


class Trackers:
    """Every selected tracker of a job (`runtime.trackers`); build it on rank 0 only."""

    def __init__(self, job, output_dir: Path, start_step: int):
        self.path = Path(output_dir) / STATE_FILE
        previous = read_state(output_dir) if start_step > 0 else {}
        self._active: list[Tracker] = []
        # What reopens each tracker's run, and the newest step sent to it. Entries of trackers not running
        # now (not selected, or failed to start) are kept for a later resume. TensorBoard has none.
        self._state: dict[str, dict] = {name: entry for name, entry in previous.items() if isinstance(entry, dict)}
        # Per appending tracker: the steps its reopened run already holds from the interrupted run.
        self._held_through: dict[str, int] = {}
        for name, required in selected_trackers(job.runtime):
            spec = TRACKERS[name]
            if not required and not installed(spec.module):
                logger.info("%s not installed; metrics go to metrics.jsonl only", name)
                continue
            saved = self._state.get(name)
            try:
                tracker = spec.load()()
                record = tracker.start(job, Path(output_dir), start_step, saved)
            except Exception as error:  # a tracker never stops training: e.g. no network for W&B online
                logger.warning("tracker %s disabled: it failed to start (%s: %s)", name, type(error).__name__, error)
                continue
            self._active.append(tracker)
            if record:
                same_run = bool(saved) and all(saved.get(key) == value for key, value in record.items())
                held = saved.get("last_step") if same_run else None  # None: nothing sent yet (step 0 may come)
                if isinstance(held, int):
                    self._held_through[name] = held
                self._state[name] = {**record, "last_step": held if isinstance(held, int) else None}
        self._save(durable=True)

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self._active]

    def log(self, step: int, record: dict) -> None:
        """Send `record` to every tracker. Several records of one step (training, then eval) all go;
        a step the reopened run already holds (module docstring) goes to no appending tracker."""
        metrics = numeric_metrics(record)
        if not metrics:
            return
        advanced = False
        for tracker in list(self._active):
            name = tracker.name
            if not tracker.replaces_steps and name in self._held_through and step <= self._held_through[name]:
                continue
            if not self._call(tracker, "log", step, metrics) or name not in self._state:
                continue
            last = self._state[name]["last_step"]
            if last is None or step > last:
                self._state[name]["last_step"], advanced = step, True
        if advanced:
            self._save()

    def flush(self) -> None:
        """Before each checkpoint publish: the trackers' own flush, and trackers.json made durable."""
        for tracker in list(self._active):
            self._call(tracker, "flush")
        self._save(durable=True)

    def finish(self, failed: bool = False) -> None:
        for tracker in list(self._active):
            self._call(tracker, "finish", failed)
        self._active = []
        self._save(durable=True)

    def _call(self, tracker: Tracker, method: str, *arguments) -> bool:
        try:
            getattr(tracker, method)(*arguments)
            return True
        except Exception as error:  # logged once: the tracker is dropped, training goes on
            logger.warning(
                "tracker %s disabled after a failed %s (%s: %s)", tracker.name, method, type(error).__name__, error
            )
            self._active.remove(tracker)
            return False

    def _save(self, durable: bool = False) -> None:
        """Rewrite trackers.json whole. After each logged step: the safe-write helper without fsync, the durability
        metrics.jsonl's lines have between publishes (a killed process loses neither; an fsync a step would
        cost ms on network filesystems). At start, each publish and the end: the safe-write helper (fsync)."""
        if not self._state:
            return
        content = json.dumps(self._state, indent=1, sort_keys=True) + "\n"
        write_file_atomic(self.path, content, durable=durable)


def tensorboard_job(enabled: bool) -> SimpleNamespace:
    """Stands for a job in a MetricsLog built without one (tools, tests): TensorBoard when asked and installed."""
    return SimpleNamespace(runtime=SimpleNamespace(trackers=None, tensorboard=enabled))
