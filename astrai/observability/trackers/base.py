"""What every experiment tracker offers the metrics log: start, log, flush, finish (rank 0 only)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any


class Tracker:
    """One experiment tracker. `start` opens (or, on a resume, reopens) its run and returns what must be
    kept in `<output_dir>/trackers.json` to reopen it (e.g. `{"run_id": ...}`); an exception from any
    method disables the tracker for the rest of the run (logged once), training goes on."""

    name = ""
    # True: the tracker replaces the steps a resumed run logs again (TensorBoard's purge_step). False: it
    # only appends, so steps it already holds are not sent twice (see astrai/observability/trackers/runs.py).
    replaces_steps = False

    def start(self, job, output_dir: Path, start_step: int, saved: dict | None) -> dict:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged durable where the tracker allows it (called before each checkpoint publish)."""

    def finish(self, failed: bool) -> None:
        """Close the run; `failed`: the training ended with an error (the run is marked so, where it can be)."""
        raise NotImplementedError


def numeric_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (no `step`, text, None, booleans or NaN), as floats."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "<redacted>"


def tracked_config(job) -> dict[str, Any]:
    """The resolved job as a tracker records it (job.yaml's content), less the values of
    `runtime.environment` variables whose names look secret (WANDB_API_KEY, HF_TOKEN, ...): a tracker
    may send its config to a server, job.yaml stays on the machine."""
    config = job.model_dump(mode="json")
    environment = config.get("runtime", {}).get("environment", {})
    for name in environment:
        if SECRET_NAME.search(name):
            environment[name] = REDACTED
    return config


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"train": {"lr": 0.1}}` -> `{"train.lr": "0.1"}`: nested mappings become dotted keys, every other
    value its JSON text (lists, null, booleans as JSON writes them), so the job reads the same everywhere."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


def run_name(output_dir: Path) -> str:
    """The tracker run's display name: the output_dir's folder name (`runs/sft` -> `sft`)."""
    return Path(output_dir).resolve().name
