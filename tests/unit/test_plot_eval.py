"""`python -m astrai plot` draws eval curves (`eval/<name>`) beside the training ones (#27)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

from astrai.observability.plot import numeric_series, panel_layout, training_first
from tests.conftest import REPO, child_env

DPI, PANEL_WIDTH, PANEL_HEIGHT = 100, 4.5, 3  # astrai/observability/plot.py's figure: 3 panels a row


def write_metrics(folder, with_eval: bool) -> None:
    records = [{"step": step, "loss": 3.0 / step, "lr": 0.01} for step in range(1, 21)]
    if with_eval:  # every 5 steps, as eval.every_steps would log them, in records of their own
        records += [{"step": step, "eval/loss": 4.0 / step, "eval/accuracy": step / 20} for step in (5, 10, 15, 20)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def plot(folder, *extra) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "astrai", "plot", str(folder), "-o", str(folder / "c.png"), *extra]
    return subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=REPO)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def test_eval_loss_shares_the_loss_panel_and_other_eval_metrics_get_their_own(tmp_path):
    write_metrics(tmp_path, with_eval=True)
    series = numeric_series([json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()])
    assert series["eval/loss"][0] == [5, 10, 15, 20]
    assert panel_layout(training_first(series), series) == [["loss", "eval/loss"], ["lr"], ["eval/accuracy"]]
    # Named metrics: a training metric brings its eval twin; an eval metric alone gets a panel.
    assert panel_layout(["loss"], series) == [["loss", "eval/loss"]]
    assert panel_layout(["eval/loss", "lr"], series) == [["eval/loss"], ["lr"]]
    assert panel_layout(["eval/loss", "loss"], series) == [["loss", "eval/loss"]]
    result = plot(tmp_path)
    assert result.returncode == 0, result.stderr
    # 3 panels in one row (not 4 in two rows): eval/loss is drawn on loss's axes.
    assert png_size(tmp_path / "c.png") == (int(3 * PANEL_WIDTH * DPI), int(PANEL_HEIGHT * DPI))


def test_a_run_without_eval_metrics_plots_as_before(tmp_path):
    write_metrics(tmp_path, with_eval=False)
    result = plot(tmp_path, "--metrics", "loss")
    assert result.returncode == 0, result.stderr
    assert png_size(tmp_path / "c.png") == (int(PANEL_WIDTH * DPI), int(PANEL_HEIGHT * DPI))
