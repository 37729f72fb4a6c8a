"""Two nodes simulated on this machine: two `python -m astrai launch --node-rank 0/1` processes
(infra.launcher no_ssh, master 127.0.0.1, one CPU rank each on gloo) started at once, as an
operator would start them on two hosts.

- training: ZeRO-2 for a few steps through the real astrai/train.py, publishing checkpoints that
  verify, with the job's runtime.environment on both ranks (read back from ranks/rank_<k>.json,
  also as delivered by the launcher, before train.py exports it again);
- `launch --check`: every rank reports, and a mismatch (a node with fewer GPUs than
  infra.gpus_per_node: these CPU nodes have none) stops BOTH nodes with the reason, no rank hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from astrai.checkpoint import list_published, verify_checkpoint
from tests.conftest import REPO, child_env, free_port, python
from tests.integration.plan import DATA, TINY_JOB

pytestmark = pytest.mark.slow
TIMEOUT_S = 600
ENVIRONMENT = {"ASTR_TEST_JOB_TOKEN": "two nodes, one job", "ASTR_TEST_FLAG": 1, "ASTR_TEST_EMPTY": None}
RENDERED = {"ASTR_TEST_JOB_TOKEN": "two nodes, one job", "ASTR_TEST_FLAG": "1", "ASTR_TEST_EMPTY": ""}


def write_two_node_job(folder: Path) -> str:
    """The tiny SFT job of plan.py, 3 steps with a checkpoint every 2, on two one-rank nodes."""
    text = TINY_JOB.format(output_dir=folder / "run", data=DATA["sft"], train_type="sft")
    text = text.replace("max_steps: 12", "max_steps: 3").replace(
        "runtime:\n", f"runtime:\n  environment: {json.dumps(ENVIRONMENT)}\n"
    )
    text += "checkpoint:\n  every_steps: 2\n"
    text += (
        "infra:\n  launcher: no_ssh\n  nodes: [{host: 127.0.0.1, slots: 1}, {host: 127.0.0.2, slots: 1}]\n"
        f"  master_addr: 127.0.0.1\n  master_port: {free_port()}\n"
    )
    path = folder / "job.yaml"
    path.write_text(text)
    return str(path)


def launch_two_nodes(folder: Path, config: str, *extra: str) -> list[tuple[int, str]]:
    """Start both nodes' launches at once; (exit status, output) of node 0 and node 1."""
    processes, logs = [], []
    for node_rank in (0, 1):
        log = open(folder / f"node{node_rank}.log", "w")
        command = [python(), "-m", "astrai", "launch", "--config", config, "--node-rank", str(node_rank), *extra]
        # Own session: on a timeout the whole tree (launch -> deepspeed -> ranks) is killed, nothing leaks.
        processes.append(
            subprocess.Popen(
                command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        logs.append(log)
    results = []
    try:
        for process in processes:
            process.wait(timeout=TIMEOUT_S)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for log in logs:
            log.close()
    for node_rank, process in enumerate(processes):
        results.append((process.returncode, (folder / f"node{node_rank}.log").read_text()))
    return results


def rank_report(folder: Path, rank: int) -> dict:
    return json.loads((folder / "run" / "ranks" / f"rank_{rank}.json").read_text())


def test_two_nodes_train_with_zero2_and_publish_a_verified_checkpoint(tmp_path):
    config = write_two_node_job(tmp_path)
    for node_rank, (code, output) in enumerate(launch_two_nodes(tmp_path, config)):
        assert code == 0, f"node {node_rank} failed ({code}):\n{output[-6000:]}"
    published = list_published(tmp_path / "run" / "checkpoints")
    assert [step for step, _ in published] == [2, 3]
    assert verify_checkpoint(published[-1][1]).step == 3  # every file re-hashed against the manifest
    manifest = json.loads((published[-1][1] / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert (
        manifest["meta"]["zero_stage"] == {"policy": 2} and manifest["meta"]["world_size"] == 2
    )  # the job's ZeRO-2, across both nodes
    for rank in (0, 1):
        facts = rank_report(tmp_path, rank)
        assert (facts["rank"], facts["node_rank"], facts["local_rank"], facts["world_size"]) == (rank, rank, 0, 2)
        assert (facts["device"], facts["backend"], facts["joined_process_group"]) == ("cpu", "gloo", True)
        assert facts["environment"] == RENDERED, f"rank {rank}"
        assert facts["environment_at_exec"] == RENDERED, (
            f"rank {rank}: the launcher did not deliver the job's environment"
        )
    preflight = json.loads((tmp_path / "run" / "ranks" / "preflight.json").read_text())
    assert preflight["problems"] == [] and [node["ranks"] for node in preflight["nodes"]] == [[0], [1]]


def test_check_reports_every_rank_and_stops_both_nodes_on_a_mismatch(tmp_path):
    config = write_two_node_job(tmp_path)
    (code0, output0), (code1, output1) = launch_two_nodes(tmp_path, config, "--check")
    assert (code0, code1) == (0, 0), output0[-4000:] + output1[-4000:]
    assert "preflight ok: 2 ranks on 2 nodes" in output0
    assert not (tmp_path / "run" / "checkpoints").exists()  # a check trains nothing
    assert rank_report(tmp_path, 1)["environment_at_exec"] == RENDERED

    config = write_two_node_job(tmp_path)  # a fresh port: the first rendezvous may linger in TIME_WAIT
    results = launch_two_nodes(tmp_path, config, "--check", "--set", "infra.gpus_per_node=1")
    for node_rank, (code, output) in enumerate(results):
        assert code == 1, f"node {node_rank} ({code}):\n{output[-4000:]}"
        assert "has 0 GPUs, infra.gpus_per_node says 1" in output
    assert json.loads((tmp_path / "run" / "ranks" / "preflight.json").read_text())["problems"]
