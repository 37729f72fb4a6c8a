"""Experiment trackers (astrai/observability/trackers/) with the real libraries, in process: a W&B offline run and an
MLflow file store hold the logged metrics and the resolved job, read back with each library's own reader;
a resume continues the same tracker runs without sending a step twice; a tracker that fails is dropped
while the others go on; a selected tracker that is not installed fails the job check, naming its extra.

No test touches the network: W&B runs offline (WANDB_MODE), MLflow writes files."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

from astrai.config import ConfigError, load_job
from astrai.observability.trackers.runs import STATE_FILE, Trackers
from tests.integration.plan import write_job

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of checksummed chunks
WANDB_HEADER = 7  # ":W&B" + magic + version, then 7 bytes before every chunk: crc32, length, type


def wandb_records(path: Path) -> list:
    """Every record of a W&B transaction log (`run-<id>.wandb`), decoded with W&B's own protobuf `Record`.

    wandb 0.31 reads this file only in its Go core (no Python reader is shipped), so the framing is
    read here: each chunk's checksum (zlib crc32 of its type byte and data) is checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, pending, position = [], b"", WANDB_HEADER
    while position + WANDB_HEADER <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        if left_in_block < WANDB_HEADER:  # block trailer: padding
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + WANDB_HEADER])
        if kind == 0 and length == 0:  # zero fill to the block's end
            position += left_in_block
            continue
        body = data[position + WANDB_HEADER : position + WANDB_HEADER + length]
        assert zlib.crc32(bytes([kind]) + body) == checksum, f"{path}: chunk at byte {position} is corrupt"
        position += WANDB_HEADER + length
        pending += body
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(run_file: Path) -> dict:
    """{run_id, config (top-level keys, JSON-decoded), history: {step: {key: value}}, exit_code} of one
    offline run file."""
    run_id, config, history, exit_code = None, {}, {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            row = history.setdefault(record.history.step.num, {})  # several log calls of one step: one row
            row.update({key: value for key, value in items.items() if not key.startswith("_")})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"run_id": run_id, "config": config, "history": history, "exit_code": exit_code}


def wandb_runs(output_dir: Path) -> list[dict]:
    """The offline runs under `<output_dir>/wandb/`, oldest first (a resume writes a second folder)."""
    return [wandb_run(path) for path in sorted(Path(output_dir, "wandb").glob("offline-run-*/run-*.wandb"))]


def mlflow_history(output_dir: Path, key: str) -> tuple[str, dict[int, list[float]]]:
    """(run_id, {step: [values]}) of `key` in the run trackers.json names, through MlflowClient."""
    from mlflow.tracking import MlflowClient

    saved = json.loads((Path(output_dir) / STATE_FILE).read_text())["mlflow"]
    points: dict[int, list[float]] = {}
    for metric in MlflowClient(saved["tracking_uri"]).get_metric_history(saved["run_id"], key):
        points.setdefault(metric.step, []).append(metric.value)
    return saved["run_id"], points


def mlflow_params(output_dir: Path) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((Path(output_dir) / STATE_FILE).read_text())["mlflow"]
    return MlflowClient(saved["tracking_uri"]).get_run(saved["run_id"]).data.params


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def tiny_job(tmp_path: Path, *sets: str):
    return load_job(write_job(tmp_path, "run"), list(sets))


def log_steps(trackers: Trackers, steps, offset: float = 0.0) -> None:
    """Per step a training record, then (as an eval does) a second record of the same step."""
    for step in steps:
        trackers.log(step, {"loss": 1.0 / step + offset, "note": "text", "flag": True, "nan": float("nan")})
        trackers.log(step, {"eval/loss": 2.0 / step + offset})


def test_wandb_and_mlflow_hold_the_metrics_and_a_resume_continues_their_runs(tmp_path):
    secret = "runtime.environment={HF_TOKEN: hf_secret, ASTR_LOG_LEVEL: INFO}"
    job = tiny_job(tmp_path, "runtime.trackers=[wandb,mlflow]", "train.lr=0.003", secret)
    output_dir = Path(job.output_dir)
    first = Trackers(job, output_dir, start_step=0)
    assert first.names == ["wandb", "mlflow"]
    log_steps(first, range(1, 6))  # steps 1-5; say the newest checkpoint is step 3 when the run dies
    first.finish(failed=True)
    from mlflow.tracking import MlflowClient

    client = MlflowClient((output_dir / "mlruns").as_uri())
    first_id = json.loads((output_dir / STATE_FILE).read_text())["mlflow"]["run_id"]
    assert client.get_run(first_id).info.status == "FAILED"
    # The resumed run starts at step 3: steps 4 and 5 are not sent again (offset: other values if they were).
    resumed = Trackers(job, output_dir, start_step=3)
    log_steps(resumed, range(4, 8), offset=100.0)
    resumed.finish()

    runs = wandb_runs(output_dir)
    assert len(runs) == 2 and runs[0]["run_id"] == runs[1]["run_id"]  # the same W&B run, resumed
    assert sorted(runs[0]["history"]) == [1, 2, 3, 4, 5]
    assert sorted(runs[1]["history"]) == [6, 7]
    assert runs[0]["history"][2] == {"loss": 0.5, "eval/loss": 1.0}
    assert runs[1]["history"][6] == {"loss": pytest.approx(1 / 6 + 100), "eval/loss": pytest.approx(2 / 6 + 100)}
    assert (runs[0]["exit_code"], runs[1]["exit_code"]) == (1, 0)
    assert runs[0]["config"]["train"]["lr"] == 0.003 and runs[0]["config"]["output_dir"] == str(output_dir)
    # A secret-looking variable's value never reaches a tracker's config (a tracker may upload it).
    assert runs[0]["config"]["runtime"]["environment"] == {"HF_TOKEN": "<redacted>", "ASTR_LOG_LEVEL": "INFO"}

    run_id, losses = mlflow_history(output_dir, "loss")
    _, eval_losses = mlflow_history(output_dir, "eval/loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7]  # each step once
    assert all(len(values) == 1 for values in losses.values())
    assert losses[5] == [pytest.approx(0.2)] and losses[7] == [pytest.approx(1 / 7 + 100)]
    assert eval_losses[1] == [2.0]
    assert run_id == first_id and client.get_run(run_id).info.status == "FINISHED"  # reopened, then finished
    params = mlflow_params(output_dir)
    assert params["train.lr"] == "0.003" and params["train.train_type"] == "sft"
    assert params["runtime.environment.HF_TOKEN"] == "<redacted>"
    assert params["runtime.environment.ASTR_LOG_LEVEL"] == "INFO"
    state = json.loads((output_dir / STATE_FILE).read_text())
    assert state["mlflow"]["run_id"] == run_id and state["wandb"]["last_step"] == 7


def test_a_fresh_start_opens_new_runs(tmp_path):
    job = tiny_job(tmp_path, "runtime.trackers=[mlflow]")
    output_dir = Path(job.output_dir)
    for _ in range(2):
        trackers = Trackers(job, output_dir, start_step=0)
        trackers.log(0, {"eval/loss": 3.0})  # an eval before the first step (eval.at_start)
        log_steps(trackers, [1, 2])
        trackers.finish()
        run_id, losses = mlflow_history(output_dir, "loss")
        assert sorted(losses) == [1, 2] and all(len(values) == 1 for values in losses.values())
        assert mlflow_history(output_dir, "eval/loss")[1] == {0: [3.0], 1: [2.0], 2: [1.0]}
    from mlflow.tracking import MlflowClient

    client = MlflowClient((output_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("astrai")
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path, caplog):
    job = tiny_job(tmp_path, "runtime.trackers=[tensorboard,mlflow]", "runtime.tensorboard=true")
    output_dir = Path(job.output_dir)
    trackers = Trackers(job, output_dir, start_step=0)
    log_steps(trackers, [1])
    board = next(tracker for tracker in trackers._active if tracker.name == "tensorboard")
    board._writer.close()
    board.log = lambda step, metrics: (_ for _ in ()).throw(OSError("disk gone"))  # the tracker's own failure
    with caplog.at_level("WARNING", logger="astrai.trackers"):
        log_steps(trackers, [2, 3])
    assert trackers.names == ["mlflow"]
    assert [record.message for record in caplog.records if "disabled" in record.message] == [
        "tracker tensorboard disabled after a failed log (OSError: disk gone)"
    ]
    trackers.finish()
    assert sorted(mlflow_history(output_dir, "loss")[1]) == [1, 2, 3]


def test_a_tracker_whose_server_is_down_is_dropped_at_start(tmp_path, monkeypatch, caplog):
    """MLflow pointed at a port where nothing listens (this machine only): one warning, the others go on."""
    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    job = tiny_job(
        tmp_path,
        "runtime.trackers=[mlflow,tensorboard]",
        "runtime.tensorboard=true",
        f"runtime.mlflow_tracking_uri=http://127.0.0.1:{free_port()}",
    )
    with caplog.at_level("WARNING", logger="astrai.trackers"):
        trackers = Trackers(job, Path(job.output_dir), start_step=0)
    assert trackers.names == ["tensorboard"]
    assert len([record for record in caplog.records if "tracker mlflow disabled" in record.message]) == 1
    log_steps(trackers, [1])
    trackers.finish()
    assert list(Path(job.output_dir, "tensorboard").glob("events.out.tfevents.*"))
    assert not (Path(job.output_dir) / STATE_FILE).exists()  # TensorBoard has no run to reopen


class HideModule:
    """A meta-path finder for which `name` is not installed."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "tensorboard"])
def test_a_tracker_not_installed_fails_the_job_check_naming_its_extra(tmp_path, monkeypatch, tracker):
    from astrai.launch.job_checks import check_job_parts

    check_job_parts(tiny_job(tmp_path), "job.yaml", 1)  # transformers' lazy imports done while wandb is visible
    job = tiny_job(tmp_path, f"runtime.trackers=[{tracker}]", f"runtime.tensorboard={tracker == 'tensorboard'}")
    for name in [name for name in sys.modules if name == tracker or name.startswith(tracker + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [HideModule(tracker), *sys.meta_path])
    with pytest.raises(ConfigError) as raised:
        check_job_parts(job, "job.yaml", 1)
    message = str(raised.value)
    assert message == f"job.yaml: runtime.trackers: {tracker} is not installed: pip install 'astrai[{tracker}]'"
    assert "\n" not in message


def test_the_older_tensorboard_key_still_selects_tensorboard(tmp_path):
    from astrai.observability.trackers import selected_trackers

    assert selected_trackers(tiny_job(tmp_path, "runtime.tensorboard=true").runtime) == [("tensorboard", False)]
    assert selected_trackers(tiny_job(tmp_path).runtime) == []  # the tiny job says tensorboard: false
    assert selected_trackers(tiny_job(tmp_path, "runtime.trackers=[mlflow]").runtime) == [("mlflow", True)]
    with pytest.raises(ConfigError, match="contradicts"):
        tiny_job(tmp_path, "runtime.trackers=[tensorboard]")  # beside the tiny job's tensorboard: false
    with pytest.raises(ConfigError, match="twice"):
        tiny_job(tmp_path, "runtime.trackers=[mlflow,mlflow]", "runtime.tensorboard=false")
    with pytest.raises(ConfigError, match="wandb_project"):
        tiny_job(tmp_path, "runtime.wandb_project=team/astrai")
