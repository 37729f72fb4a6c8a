"""Weights & Biases: offline unless the environment says otherwise; never blocks training on the network.

Mode: `WANDB_MODE` from the environment when set; else online when `WANDB_API_KEY` is set; else offline
(the run is written under `<output_dir>/wandb/` and `wandb sync <output_dir>/wandb/offline-run-*` uploads
it later). `wandb.init` is bounded by `init_timeout`; any failure disables the tracker
(astrai/observability/trackers/runs.py).
The run's config is the resolved job (nested, as job.yaml; the W&B UI shows it as dotted keys).
A resume reopens the same run id (`resume="allow"`); offline, W&B writes the resumed part as a second
offline-run folder of the same id, and `wandb sync` uploads the two in order.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from astrai.observability.trackers.base import Tracker, run_name, tracked_config

logger = logging.getLogger("astrai.trackers")

INIT_TIMEOUT_S = 60.0
FINISH_TIMEOUT_S = 120.0  # online, finish() waits for the upload; past this the run ends without waiting


def wandb_mode(environment=os.environ) -> str | None:
    """None: W&B's own setting from the environment (WANDB_MODE); else online with an API key, offline without."""
    if environment.get("WANDB_MODE"):
        return None
    return "online" if environment.get("WANDB_API_KEY") else "offline"


class WandbTracker(Tracker):
    name = "wandb"

    def start(self, job, output_dir: Path, start_step: int, saved: dict | None) -> dict:
        mode = wandb_mode()
        if mode is not None:
            # Through the environment, not only wandb.init(mode=...): W&B's process-wide settings (its own
            # telemetry probe, which looks up its server) read WANDB_MODE, and offline must mean no network.
            os.environ["WANDB_MODE"] = mode
        import wandb

        run_id = (saved or {}).get("run_id")  # None: W&B draws a new id
        settings = wandb.Settings(
            init_timeout=INIT_TIMEOUT_S,
            console="off",  # the ranks' own log capture stays as it is
            silent=True,
            disable_git=True,
        )
        self._run = wandb.init(
            project=job.runtime.wandb_project,
            name=run_name(output_dir),
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            config=tracked_config(job),
            settings=settings,
        )
        mode = "offline" if self._run.offline else "online"
        logger.info("wandb run %s (%s) in %s", self._run.id, mode, self._run.dir)
        return {"run_id": self._run.id}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def finish(self, failed: bool) -> None:
        finisher = threading.Thread(
            target=self._run.finish, kwargs={"exit_code": 1 if failed else 0}, name="wandb-finish", daemon=True
        )
        finisher.start()
        finisher.join(FINISH_TIMEOUT_S)
        if finisher.is_alive():
            logger.warning(
                "wandb: the upload did not finish within %.0f s; the run's files stay in %s (wandb sync uploads them)",
                FINISH_TIMEOUT_S,
                self._run.dir,
            )
