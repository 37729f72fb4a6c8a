"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow (`runtime.trackers`).

A small registry: one module per tracker, each a `Tracker` (astrai/observability/trackers/base.py) whose
library is an optional extra (`pip install astrai[wandb]`). Only rank 0 runs trackers
(astrai/observability/metrics.py owns them through `Trackers`, astrai/observability/trackers/runs.py).
`missing_tracker` is the check that astrai/launch/job_checks.py runs before any rank starts: it looks the
library up without importing it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class TrackerSpec:
    name: str
    module: str  # the library that must be installed
    extra: str  # `pip install astrai[<extra>]`
    implementation: str  # "astrai.observability.trackers.<module>:<Class>"

    def load(self):
        module, _, attribute = self.implementation.partition(":")
        return getattr(importlib.import_module(module), attribute)


TRACKERS = {
    spec.name: spec
    for spec in (
        TrackerSpec(
            "tensorboard",
            "tensorboard",
            "tensorboard",
            "astrai.observability.trackers.tensorboard_tracker:TensorBoardTracker",
        ),
        TrackerSpec("wandb", "wandb", "wandb", "astrai.observability.trackers.wandb_tracker:WandbTracker"),
        TrackerSpec("mlflow", "mlflow", "mlflow", "astrai.observability.trackers.mlflow_tracker:MlflowTracker"),
    )
}


def selected_trackers(runtime) -> list[tuple[str, bool]]:
    """(name, required) for each tracker a job's `runtime` asks for. `runtime.trackers` unset keeps the
    older `runtime.tensorboard` key's meaning: TensorBoard when it is installed (not required)."""
    if runtime.trackers is None:
        return [("tensorboard", False)] if runtime.tensorboard else []
    return [(name, True) for name in runtime.trackers]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name, or a half-imported module
        return False


def missing_tracker(runtime) -> str | None:
    """One line naming the first selected tracker whose library is not installed, and its extra."""
    for name, required in selected_trackers(runtime):
        spec = TRACKERS[name]
        if required and not installed(spec.module):
            return f"runtime.trackers: {name} is not installed: pip install 'astrai[{spec.extra}]'"
    return None
