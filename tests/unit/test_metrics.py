"""metrics.jsonl writing, trimming on resume, and the plot tool."""

from __future__ import annotations

import json
import subprocess
import sys

from astrai.observability.metrics import MetricsLog, read_metrics, trim_metrics
from astrai.observability.plot import numeric_series
from tests.conftest import REPO, child_env


def test_log_flush_and_trim(tmp_path):
    log = MetricsLog(tmp_path, is_main=True, total_steps=5, start_step=0, tensorboard=True, progress_bar=False)
    for step in range(1, 6):
        log.log(step, {"loss": 1.0 / step, "lr": 0.1, "grad_norm": None})
    log.flush()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "loss": 0.1')  # a line torn by a crash
    assert trim_metrics(tmp_path / "metrics.jsonl", 3) == 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, is_main=False, total_steps=5, start_step=0, tensorboard=True, progress_bar=True)
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_numeric_series_skips_text_and_none():
    series = numeric_series(
        [{"step": 1, "loss": 2.0, "note": "x", "grad_norm": None, "ok": True}, {"step": 2, "loss": 1.0}]
    )
    assert series == {"loss": ([1, 2], [2.0, 1.0])}


def test_plot_tool_writes_png(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 3.0 / s, "lr": 0.01}) + "\n" for s in range(1, 20))
    )
    result = subprocess.run(
        [sys.executable, "-m", "astrai", "plot", str(tmp_path), "-o", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run(
        [sys.executable, "-m", "astrai", "plot", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    assert missing.returncode == 1 and "no metrics.jsonl" in missing.stderr
