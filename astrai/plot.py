"""`python -m astrai plot <output_dir> [-o curves.png]`: every numeric metric against the step."""

from __future__ import annotations

import math
from pathlib import Path

from astrai.metrics import METRICS_FILE, read_metrics

SKIPPED = {"step"}


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


def plot_metrics(output_dir: str | Path, destination: str | Path | None = None, names: list[str] | None = None) -> Path:
    """Draw each metric (or only `names`, in that order) against the step into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    source = output_dir / METRICS_FILE if output_dir.is_dir() else output_dir
    if not source.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {output_dir}")
    series = numeric_series(read_metrics(source))
    if names:
        unknown = [name for name in names if name not in series]
        if unknown:
            raise ValueError(
                f"{source} has no numeric metric {', '.join(unknown)} (it has: {', '.join(sorted(series))})"
            )
        series = {name: series[name] for name in names}
    if not series:
        raise ValueError(f"{source} holds no numeric metric")
    columns = min(3, len(series))
    rows = math.ceil(len(series) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3 * rows), squeeze=False)
    for axis, (name, (steps, values)) in zip(axes.flat, series.items() if names else sorted(series.items())):
        axis.plot(steps, values, linewidth=1.2)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(series) :]:
        axis.set_visible(False)
    figure.suptitle(str(source))
    figure.tight_layout()
    destination = Path(destination) if destination else source.parent / "curves.png"
    figure.savefig(destination, dpi=100)
    plt.close(figure)
    return destination
