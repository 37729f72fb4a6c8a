"""`python -m astrai plot <output_dir> [-o curves.png]`: every numeric metric against the step.

Eval metrics (`eval/<name>`, logged every eval.every_steps) are drawn beside the training ones: on the same
axes as the training metric of the same name (`eval/loss` over `loss`, with markers, since they are sparse),
or on a panel of their own when training has no such metric (`eval/accuracy`, `eval/reward_mean`).
"""

from __future__ import annotations

import math
from pathlib import Path

from astrai.observability.metrics import METRICS_FILE, read_metrics

SKIPPED = {"step"}
EVAL_PREFIX = "eval/"


def numeric_series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for key, value in record.items():
            if (
                key in SKIPPED
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(record["step"])
            values.append(value)
    return series


def training_first(series: dict) -> list[str]:
    """Every metric name: the training ones sorted, then the eval ones."""
    return sorted(series, key=lambda name: (name.startswith(EVAL_PREFIX), name))


def panel_layout(names: list[str], series: dict) -> list[list[str]]:
    """The panels to draw, each the metric names on its axes: a training metric with its `eval/` twin
    when the metrics hold one, an eval metric alone when no named training metric takes it."""
    layout: list[list[str]] = []
    for name in names:
        if name.startswith(EVAL_PREFIX) and name.removeprefix(EVAL_PREFIX) in names:
            continue  # drawn on its training metric's panel
        twin = EVAL_PREFIX + name
        layout.append([name, twin] if not name.startswith(EVAL_PREFIX) and twin in series else [name])
    return layout


def plot_metrics(output_dir: str | Path, destination: str | Path | None = None, names: list[str] | None = None) -> Path:
    """Draw each metric (or only `names`, in that order; a named training metric brings its eval twin) against
    the step into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    source = output_dir / METRICS_FILE if output_dir.is_dir() else output_dir
    if not source.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {output_dir}")
    series = numeric_series(read_metrics(source, skip_torn_last=True))  # plotting a crashed run is the point
    if names:
        unknown = [name for name in names if name not in series]
        if unknown:
            raise ValueError(
                f"{source} has no numeric metric {', '.join(unknown)} (it has: {', '.join(sorted(series))})"
            )
        series = {name: series[name] for name in names}
    if not series:
        raise ValueError(f"{source} holds no numeric metric")
    layout = panel_layout(names or training_first(series), series)
    columns = min(3, len(layout))
    rows = math.ceil(len(layout) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, layout):
        for key in panel:
            steps, values = series[key]
            evaluated = key.startswith(EVAL_PREFIX)
            axis.plot(
                steps,
                values,
                linewidth=1.2,
                marker="o" if evaluated else None,
                markersize=3,
                label="eval" if evaluated else "train",
            )
        if len(panel) > 1:
            axis.legend(fontsize="small")
        axis.set_title(panel[0])
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(layout) :]:
        axis.set_visible(False)
    figure.suptitle(str(source))
    figure.tight_layout()
    destination = Path(destination) if destination else source.parent / "curves.png"
    figure.savefig(destination, dpi=100)
    plt.close(figure)
    return destination
