"""A real one-rank training run with W&B (offline) and MLflow (file store) as trackers, from a user's
environment (no WANDB_MODE, no API key) under the network spy: the runs hold metrics.jsonl's figures,
read back with each library's own reader, and nothing tried to leave the machine.

The run is then resumed as after a crash: its final checkpoint (step 5) is removed, so the resume starts
from step 4 while both trackers already hold step 5. The resumed run continues the same tracker runs and
sends neither step 5 nor any earlier step a second time."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import REPO, launch_ranks, user_env
from tests.integration.plan import metrics, write_job
from tests.unit.trackers.test_trackers import mlflow_history, mlflow_params, wandb_runs

pytestmark = pytest.mark.slow


def drop_checkpoint(path: str) -> None:
    """run_plan.py `prepare`: the final checkpoint never got published (the run died after logging step 5)."""
    shutil.rmtree(path)


def test_wandb_and_mlflow_runs_hold_the_training_metrics_across_a_resume(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    config = write_job(tmp_path, "tracked", "sft")
    every = ["runtime.trackers=[wandb,mlflow]", "checkpoint.every_steps=2"]
    final = tmp_path / "tracked" / "checkpoints" / "step_00000005"
    runs = [
        {"name": "first", "config": config, "set": every + ["train.max_steps=5"]},
        {
            "name": "resumed",
            "config": config,
            "set": every + ["train.max_steps=7"],
            "prepare": ["tests.integration.test_trackers_ranks:drop_checkpoint", str(final)],
        },
    ]
    plan, results = tmp_path / "plan.json", tmp_path / "results.json"
    plan.write_text(json.dumps({"results": str(results), "runs": runs}))
    network_log = tmp_path / "network.log"
    completed = launch_ranks(
        [REPO / "tests/integration/run_plan.py", "--plan", plan], 1, 600, env=user_env(network_log)
    )
    assert completed.returncode == 0, f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    outcome = json.loads(results.read_text())
    assert outcome["first"]["ok"] and outcome["resumed"]["ok"], outcome
    assert outcome["resumed"]["step"] == 7
    assert not network_log.exists(), network_log.read_text()

    records = {record["step"]: record for record in metrics(tmp_path, "tracked")}
    assert sorted(records) == [1, 2, 3, 4, 5, 6, 7]  # trimmed to step 4 at the resume, then 5-7 again
    output_dir = tmp_path / "tracked"

    first, resumed = wandb_runs(output_dir)  # offline: one run folder per attempt, one run id
    assert first["run_id"] == resumed["run_id"]
    assert sorted(first["history"]) == [1, 2, 3, 4, 5] and sorted(resumed["history"]) == [6, 7]
    for step in (1, 2, 3, 4, 6, 7):
        logged = (first if step <= 5 else resumed)["history"][step]
        assert logged["loss"] == records[step]["loss"] and logged["lr"] == records[step]["lr"]
        assert logged["tokens"] == records[step]["tokens"]
    # Step 5 stays as the interrupted run logged it; the resume retraced it (CPU, fp32: the same figure).
    assert first["history"][5]["loss"] == pytest.approx(records[5]["loss"], rel=1e-5)
    assert first["config"]["train"]["max_steps"] == 5 and resumed["config"]["train"]["max_steps"] == 7

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only with it, as `mlflow ui`
    run_id, losses = mlflow_history(output_dir, "loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7]
    assert all(len(values) == 1 for values in losses.values())  # no step sent twice
    for step in (1, 2, 3, 4, 6, 7):
        assert losses[step] == [pytest.approx(records[step]["loss"], rel=1e-12)]
    params = mlflow_params(output_dir)
    assert params["train.train_type"] == "sft" and params["checkpoint.every_steps"] == "2"
    assert params["train.max_steps"] == "5"  # MLflow keeps a run's first params (the resume warned)
    state = json.loads((output_dir / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == run_id and state["wandb"]["run_id"] == first["run_id"]
    assert state["wandb"]["last_step"] == state["mlflow"]["last_step"] == 7
