"""`python -m astrai launch` (astrai/launch/multinode.py) and the rank-side report and preflight
(astrai/launch/preflight.py).

Dry runs check the exact DeepSpeed command of each launcher. The environment file is checked against
DeepSpeed's real runner: it is started with fake `ssh`/`pdsh`/`mpirun`/`srun` programs that record what
they were asked to run, and the exports they got are evaluated the way the nodes would (pdsh: a shell).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.engine import DistInfo
from astrai.launch import environment as rank_environment
from astrai.launch import multinode as launch
from astrai.launch import preflight
from astrai.launch.multinode import LaunchError, launch_main
from astrai.launch.preflight import PreflightError
from tests.conftest import REPO, child_env

DEEPSPEED = launch.deepspeed_program()
TRAIN = str(REPO / "astrai" / "train.py")
JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}}}
train: {{train_type: sft, max_steps: 2}}
"""
ENVIRONMENT = """\
runtime:
  environment:
    NCCL_DEBUG: INFO
    ASTR_TEST_NULL: null
    ASTR_TEST_BOOL: true
    ASTR_TEST_NUMBER: 1.5e-3
    ASTR_TEST_INT: 8
    ASTR_TEST_WORDS: two words
    ASTR_TEST_PUNCTUATION: "a=b;c|d (e) 'f' #g"
"""
RENDERED = {
    "NCCL_DEBUG": "INFO",
    "ASTR_TEST_NULL": "",
    "ASTR_TEST_BOOL": "True",
    "ASTR_TEST_NUMBER": "0.0015",
    "ASTR_TEST_INT": "8",
    "ASTR_TEST_WORDS": "two words",
    "ASTR_TEST_PUNCTUATION": "a=b;c|d (e) 'f' #g",
}
TWO_NODES = "infra:\n  launcher: {launcher}\n  nodes: [{{host: node-a, slots: 8}}, {{host: node-b, slots: 8}}]\n"


def write_job(folder: Path, *sections: str) -> str:
    path = folder / "job.yaml"
    path.write_text(JOB.format(output_dir=folder / "out", data=REPO / "data/arithmetic/sft.jsonl") + "".join(sections))
    return str(path)


@pytest.fixture(autouse=True)
def no_nccl_in_this_shell(monkeypatch):
    """NCCL_* of the shell running the tests (or left by another test) would add a warning."""
    for name in [key for key in os.environ if key.startswith("NCCL_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def resolver(monkeypatch):
    """Host names resolve except those starting with `nosuch` (no DNS in unit tests)."""

    def getaddrinfo(host, port, *args, **kwargs):
        if str(host).startswith("nosuch"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def dry_run(capsys, config: str, *extra: str) -> tuple[int, str, str]:
    code = launch_main(["--config", config, "--dry-run", *extra])
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err


def expected(
    folder: Path, flags: list[str], *, environment: dict | None = None, script: str = TRAIN, sets: tuple = ()
) -> str:
    launch_dir = folder / "out" / "launch"
    command = ["env", f"DS_ENV_FILE={launch_dir}/deepspeed_env", *(f"{k}={v}" for k, v in (environment or {}).items())]
    command += [DEEPSPEED, "--hostfile", f"{launch_dir}/hostfile", *flags, script, "--config", str(folder / "job.yaml")]
    for assignment in sets:
        command += ["--set", assignment]
    return shlex.join(command)


# ---- exact commands -----------------------------------------------------------------------------


def test_dry_run_pdsh_passes_overrides_through(tmp_path, capsys, resolver):
    config = write_job(tmp_path, TWO_NODES.format(launcher="pdsh"))
    code, out, _ = dry_run(capsys, config, "--set", "train.lr=3e-4", "--set", "train.max_steps=7")
    flags = ["--master_addr", "node-a", "--master_port", "29500", "--launcher", "pdsh", "--force_multi"]
    assert code == 0
    assert out == expected(tmp_path, flags, sets=("train.lr=3e-4", "train.max_steps=7"))
    assert (tmp_path / "out/launch/hostfile").read_text() == "node-a slots=8\nnode-b slots=8\n"
    assert (tmp_path / "out/launch/deepspeed_env").read_text() == ""


def test_dry_run_openmpi_exports_the_rendezvous_to_ranks_mpirun_starts(tmp_path, capsys, resolver):
    config = write_job(
        tmp_path,
        TWO_NODES.format(launcher="openmpi") + "  master_addr: 10.1.2.3\n  master_port: 29600\n",
        "runtime: {environment: {NCCL_DEBUG: WARN}}\n",
    )
    code, out, _ = dry_run(capsys, config, "--launcher-args", "--mca btl_tcp_if_include ib0")
    flags = [
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "29600",
        "--launcher",
        "openmpi",
        "--force_multi",
        "--launcher_args",
        "--mca btl_tcp_if_include ib0",
    ]
    assert code == 0 and out == expected(tmp_path, flags)
    env_file = (tmp_path / "out/launch/deepspeed_env").read_text()
    assert env_file == "NCCL_DEBUG=WARN\nASTR_LAUNCHER=openmpi\nMASTER_ADDR=10.1.2.3\nMASTER_PORT=29600\n"


def test_dry_run_slurm_skips_the_ssh_check_and_asks_for_the_nodes(tmp_path, capsys, resolver):
    config = write_job(tmp_path, TWO_NODES.format(launcher="slurm"))
    code, out, _ = dry_run(capsys, config)
    flags = [
        "--master_addr",
        "node-a",
        "--master_port",
        "29500",
        "--launcher",
        "slurm",
        "--force_multi",
        "--no_ssh_check",
        "--num_nodes",
        "2",
    ]
    assert code == 0 and out == expected(tmp_path, flags)
    assert (
        "ASTR_LAUNCHER=slurm\nMASTER_ADDR=node-a\nMASTER_PORT=29500\n"
        in (tmp_path / "out/launch/deepspeed_env").read_text()
    )


def test_dry_run_no_ssh_puts_the_environment_on_the_command(tmp_path, capsys, resolver):
    config = write_job(tmp_path, TWO_NODES.format(launcher="no_ssh"), ENVIRONMENT)
    code, out, _ = dry_run(capsys, config, "--node-rank", "1")
    flags = [
        "--master_addr",
        "node-a",
        "--master_port",
        "29500",
        "--no_ssh",
        "--node_rank",
        "1",
        "--num_nodes",
        "2",
        "--num_gpus",
        "8",
    ]
    assert code == 0 and out == expected(tmp_path, flags, environment=RENDERED)
    assert shlex.split(out)[1:9] == ["DS_ENV_FILE=" + str(tmp_path / "out/launch/deepspeed_env")] + [
        f"{k}={v}" for k, v in RENDERED.items()
    ]


def test_dry_run_no_ssh_with_unequal_slots_leaves_the_counts_to_the_hostfile(tmp_path, capsys, resolver):
    nodes = "infra:\n  launcher: no_ssh\n  nodes: [{host: node-a, slots: 8}, {host: node-b, slots: 4}]\n"
    code, out, _ = dry_run(capsys, write_job(tmp_path, nodes), "--node-rank", "0")
    assert code == 0 and "--num_nodes 2 " + TRAIN in out and "--num_gpus" not in out


def test_check_starts_the_preflight_instead_of_training(tmp_path, capsys, resolver):
    config = write_job(tmp_path, TWO_NODES.format(launcher="pdsh"))
    code, out, _ = dry_run(capsys, config, "--check")
    flags = ["--master_addr", "node-a", "--master_port", "29500", "--launcher", "pdsh", "--force_multi"]
    assert code == 0 and out == expected(tmp_path, flags, script=str(REPO / "astrai" / "launch" / "preflight.py"))


def test_a_hostfile_is_read_relative_to_the_job_and_rewritten(tmp_path, capsys, resolver):
    (tmp_path / "hosts").write_text("# the cluster\nnode-a slots=8 max_slots=8\n\n  node-b   slots=4\n")
    config = write_job(tmp_path, "infra: {hostfile: hosts}\n")
    code, _, err = dry_run(capsys, config)
    assert code == 0, err
    assert (tmp_path / "out/launch/hostfile").read_text() == "node-a slots=8\nnode-b slots=4\n"


# ---- host lists that cannot work ----------------------------------------------------------------

BAD_HOSTS = {
    "no nodes at all": ("infra: {launcher: pdsh}\n", "needs infra.nodes or infra.hostfile"),
    "empty nodes": ("infra: {nodes: []}\n", "infra.nodes lists no nodes"),
    "zero slots": (
        "infra: {nodes: [{host: node-a, slots: 0}]}\n",
        "infra.nodes.0.slots: Input should be greater than or equal to 1",
    ),
    "zero slots in a hostfile": ("infra: {hostfile: HOSTS}\n", "has slots=0; every node runs at least one rank"),
    "bad hostfile line": ("infra: {hostfile: HOSTS}\n", "'node-b' is not a `host slots=N` line"),
    "missing hostfile": ("infra: {hostfile: missing_hosts}\n", "infra.hostfile: 'missing_hosts' does not exist"),
    "host twice": (
        "infra: {nodes: [{host: node-a, slots: 1}, {host: node-a, slots: 1}]}\n",
        "infra.nodes[1]: host node-a is listed twice (also at infra.nodes[0])",
    ),
    "unresolvable host": (
        "infra: {nodes: [{host: node-a, slots: 1}, {host: nosuch-b, slots: 1}]}\n",
        "infra.nodes[1]: host 'nosuch-b' does not resolve",
    ),
    "unresolvable master": (
        "infra: {master_addr: nosuch-master, nodes: [{host: node-a, slots: 1}]}\n",
        "infra.master_addr: host 'nosuch-master' does not resolve",
    ),
    "loopback master": (
        "infra: {master_addr: 127.0.0.1, nodes: [{host: node-a, slots: 1}, {host: node-b, slots: 1}]}\n",
        "127.0.0.1 is a loopback address, which node-a, node-b cannot reach",
    ),
    "host with a comma": ("infra: {nodes: [{host: 'node-a,node-b', slots: 1}]}\n", "is not a host name"),
    "slurm unequal slots": (
        "infra: {launcher: slurm, nodes: [{host: node-a, slots: 8}, {host: node-b, slots: 4}]}\n",
        "slots differ: node-a=8, node-b=4",
    ),
    "more slots than gpus": (
        "infra: {gpus_per_node: 4, nodes: [{host: node-a, slots: 8}]}\n",
        "slots=8, more ranks than infra.gpus_per_node=4",
    ),
}
HOSTFILES = {"zero slots in a hostfile": "node-a slots=0\n", "bad hostfile line": "node-a slots=2\nnode-b\n"}


@pytest.mark.parametrize("case", sorted(BAD_HOSTS))
def test_a_wrong_host_list_fails_before_anything_starts(tmp_path, capsys, resolver, case):
    infra, message = BAD_HOSTS[case]
    if case in HOSTFILES:
        (tmp_path / "hosts").write_text(HOSTFILES[case])
        infra = infra.replace("HOSTS", str(tmp_path / "hosts"))
    code, out, err = dry_run(capsys, write_job(tmp_path, infra))
    assert code == 2 and out == ""
    assert err.startswith("astrai launch: ") and message in err, err
    assert not (tmp_path / "out/launch").exists()


@pytest.mark.parametrize(
    "launcher, arguments, message",
    [
        (
            "no_ssh",
            [],
            "infra.launcher no_ssh: give --node-rank K and run the same launch on every node (K = 0 .. 1, 0 on node-a)",
        ),
        ("no_ssh", ["--node-rank", "2"], "--node-rank 2: the job has 2 nodes (0 .. 1)"),
        ("pdsh", ["--node-rank", "0"], "--node-rank is for infra.launcher no_ssh only; pdsh starts every node itself"),
    ],
)
def test_node_rank_belongs_to_no_ssh(tmp_path, capsys, resolver, launcher, arguments, message):
    code, _, err = dry_run(capsys, write_job(tmp_path, TWO_NODES.format(launcher=launcher)), *arguments)
    assert code == 2 and message in err, err


def test_a_missing_launcher_program_is_named(tmp_path, capsys, resolver, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither pdsh nor anything else
    code = launch_main(["--config", write_job(tmp_path, TWO_NODES.format(launcher="pdsh"))])
    assert code == 2 and "infra.launcher pdsh: pdsh not found on this machine" in capsys.readouterr().err


def test_an_invalid_job_is_one_message_and_status_2(tmp_path, capsys):
    code, _, err = dry_run(capsys, write_job(tmp_path, TWO_NODES.format(launcher="pdsh")), "--set", "train.lr=-1")
    assert code == 2 and "train.lr: Input should be greater than 0" in err and "Traceback" not in err


# ---- the environment file -----------------------------------------------------------------------


def test_environment_is_rendered_as_train_py_exports_it(monkeypatch):
    from astrai.config import parse_yaml
    from astrai.launch.environment import apply_environment

    environment = parse_yaml(ENVIRONMENT)["runtime"]["environment"]
    values, warnings = launch.check_environment(environment, "pdsh")
    assert values == RENDERED
    for key in RENDERED:
        monkeypatch.setenv(key, "before")  # so that the test's end restores each one
    apply_environment(environment)
    assert {key: os.environ[key] for key in RENDERED} == values
    assert warnings == [
        "runtime.environment.ASTR_TEST_BOOL: YAML true is exported as 'True'; NCCL and most C libraries want 1 or 0"
    ]


@pytest.mark.parametrize(
    "environment, launcher, message",
    [
        ({"A": "two\nlines"}, "pdsh", "a value of several lines"),
        ({"A": " padded"}, "pdsh", "starts or ends with white space"),
        ({"A": "$HOME/x"}, "pdsh", 'holds one of " $ ` \\'),
        ({"A": 'say "hi"'}, "openmpi", 'holds one of " $ ` \\'),
        ({"A": "a,b"}, "slurm", "holds a comma"),
        ({"RANK": 0}, "pdsh", "runtime.environment.RANK: set for each rank by the launcher"),
        ({"MASTER_ADDR": "x"}, "pdsh", "set infra.master_addr instead"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "no_ssh", "from the node's slots"),
        ({"1BAD": "x"}, "pdsh", "not a variable name"),
    ],
)
def test_values_the_environment_file_would_change_are_refused(environment, launcher, message):
    with pytest.raises(LaunchError) as raised:
        launch.check_environment(environment, launcher)
    assert message in str(raised.value)


def test_values_quoted_on_the_way_to_mpirun_are_warned_about():
    _, warnings = launch.check_environment({"A": "two words", "B": "plain/path-1.0"}, "openmpi")
    assert len(warnings) == 1 and "'two words' to openmpi inside double quotes" in warnings[0]


HOST_SHELL_NCCL = {"NCCL_SOCKET_IFNAME": "eth9", "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_DEBUG": "TRACE"}


def test_nccl_variables_of_this_shell_reach_no_rank_unless_the_job_lists_them(tmp_path, capsys, monkeypatch, resolver):
    """no_ssh: the ranks inherit the launcher's environment, so the job's values and nothing else."""
    for key, value in HOST_SHELL_NCCL.items():
        monkeypatch.setenv(key, value)
    config = write_job(tmp_path, TWO_NODES.format(launcher="no_ssh"), ENVIRONMENT)  # lists NCCL_DEBUG: INFO
    code, out, err = dry_run(capsys, config, "--node-rank", "0")
    assert code == 0, err
    assert (
        "warning: not passed to the job: NCCL_SOCKET_IFNAME, TORCH_NCCL_BLOCKING_WAIT (set in this shell, not "
        "in runtime.environment" in err
    )
    assert shlex.split(out)[:5] == ["env", "-u", "NCCL_SOCKET_IFNAME", "-u", "TORCH_NCCL_BLOCKING_WAIT"]
    from astrai.launch.job_checks import load_and_check

    plan = launch.plan_launch(load_and_check(config, []), config, [], node_rank=0)
    handed = plan.launcher_environment(os.environ)
    assert "NCCL_SOCKET_IFNAME" not in handed and "TORCH_NCCL_BLOCKING_WAIT" not in handed
    assert (
        handed["NCCL_DEBUG"] == "INFO" and handed["PATH"] == os.environ["PATH"]
    )  # the job's value; the rest of the shell stays


FAKE_SSH = """#!{python}
# Fake ssh: appends `host command...` to {log}; fails like sshd refusing for hosts in $FAKE_SSH_DOWN.
import os, sys
args, index = sys.argv[1:], 0
while args[index].startswith("-"):
    index += 2 if args[index] == "-o" else 1
open({log!r}, "a").write(" ".join(args[index:]) + "\\n")
if args[index] in os.environ.get("FAKE_SSH_DOWN", "").split(","):
    sys.exit(f"ssh: connect to host {{args[index]}} port 22: Connection refused")
"""


def fake_programs(folder: Path, record: Path) -> Path:
    """ssh that succeeds unless told otherwise (logging each call to ssh.log); pdsh, mpirun and srun that
    record their argv (and their environment, in <record>.env); the probes DeepSpeed runs."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    recorder = (
        f"#!{sys.executable}\nimport json, os, sys\njson.dump(sys.argv, open({str(record)!r}, 'w'))\n"
        f"json.dump(dict(os.environ), open({str(record) + '.env'!r}, 'w'))\n"
    )
    ssh = FAKE_SSH.format(python=sys.executable, log=str(folder / "ssh.log"))
    for name, body in {
        "ssh": ssh,
        "ompi_info": "#!/bin/sh\nexit 0\n",
        "sinfo": "#!/bin/sh\nexit 0\n",
        "pdsh": recorder,
        "mpirun": recorder,
        "srun": recorder,
    }.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def launch_with_fakes(tmp_path, capsys, monkeypatch, launcher: str, expect: int = 0) -> list[str]:
    """A real (not dry) launch through DeepSpeed's runner, down to the program that would reach the nodes."""
    record = tmp_path / "argv.json"
    monkeypatch.setenv("PATH", f"{fake_programs(tmp_path, record)}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("ASTR_TEST_STRAY=from another job\n")  # must never be read
    monkeypatch.setenv("HOME", str(home))
    for key, value in child_env().items():
        monkeypatch.setenv(key, value)
    nodes = f"infra:\n  launcher: {launcher}\n  nodes: [{{host: localhost, slots: 2}}, {{host: 127.0.0.2, slots: 2}}]\n"
    environment = (
        ENVIRONMENT.replace("    ASTR_TEST_PUNCTUATION", "    ASTR_TEST_PUNCTUATION_UNUSED")
        if launcher == "slurm"
        else ENVIRONMENT
    )
    code = launch_main(["--config", write_job(tmp_path, nodes, environment)])
    assert code == expect, capsys.readouterr().err
    return json.loads(record.read_text()) if record.exists() else []


def ssh_calls(tmp_path) -> list[str]:
    log = tmp_path / "ssh.log"
    return log.read_text().splitlines() if log.exists() else []


def test_pdsh_nodes_get_every_value_exactly_and_nothing_stray(tmp_path, capsys, monkeypatch):
    argv = launch_with_fakes(tmp_path, capsys, monkeypatch, "pdsh")
    assert argv[argv.index("-w") + 1] == "localhost,127.0.0.2"
    exports = next(part for part in argv if part.startswith("export "))
    # What each node's shell does with the line pdsh hands it.
    shell = subprocess.run(
        ["bash", "-c", f"{exports} env -0"],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    seen = dict(item.split("=", 1) for item in shell.stdout.split("\0") if "=" in item)
    assert {key: seen.get(key) for key in RENDERED} == RENDERED
    assert "ASTR_TEST_STRAY" not in seen
    # Every node was probed the way pdsh reaches it before anything started.
    probes = sorted(
        call for call in ssh_calls(tmp_path) if call.endswith(" true")
    )  # DeepSpeed's own check runs `hostname`
    assert probes == ["127.0.0.2 true", "localhost true"]


def test_pdsh_gets_no_nccl_variable_of_this_shell_the_job_does_not_list(tmp_path, capsys, monkeypatch):
    """On CUDA hosts DeepSpeed's runner exports every NCCL_* of its own environment to all nodes."""
    for key, value in HOST_SHELL_NCCL.items():
        monkeypatch.setenv(key, value)
    argv = launch_with_fakes(tmp_path, capsys, monkeypatch, "pdsh")
    handed = json.loads((tmp_path / "argv.json.env").read_text())  # the environment DeepSpeed's runner ran pdsh with
    assert not [key for key in handed if key.startswith(("NCCL_", "TORCH_NCCL_"))]
    exports = next(part for part in argv if part.startswith("export "))
    assert "NCCL_DEBUG=INFO;" in exports and "TRACE" not in exports and "NCCL_SOCKET_IFNAME" not in exports


def test_a_node_ssh_cannot_reach_fails_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_DOWN", "127.0.0.2")
    assert launch_with_fakes(tmp_path, capsys, monkeypatch, "pdsh", expect=2) == []  # pdsh never ran
    err = capsys.readouterr().err
    assert (
        "not reachable by passwordless ssh" in err
        and "127.0.0.2 (infra.nodes[1]): ssh: connect to host 127.0.0.2 port 22: Connection refused" in err
    )
    assert "localhost" not in err.split("not reachable")[1]
    assert sorted(ssh_calls(tmp_path)) == ["127.0.0.2 true", "localhost true"]
    assert not (tmp_path / "out/launch").exists()


def test_the_ssh_probe_is_skipped_for_dry_runs_and_slurm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_DOWN", "localhost,127.0.0.2")
    launch_with_fakes(tmp_path, capsys, monkeypatch, "slurm")
    config = write_job(
        tmp_path, "infra:\n  launcher: pdsh\n  nodes: [{host: localhost, slots: 1}, {host: 127.0.0.2, slots: 1}]\n"
    )
    code, _, err = dry_run(capsys, config)
    assert code == 0, err
    assert ssh_calls(tmp_path) == []


def quoted(value: str) -> str:
    return f'"{value}"' if launch.NEEDS_QUOTES.search(value) else value


def test_mpirun_gets_the_values_and_the_rendezvous(tmp_path, capsys, monkeypatch):
    argv = launch_with_fakes(tmp_path, capsys, monkeypatch, "openmpi")
    assert argv[1:5] == ["-n", "4", "-hostfile", str(tmp_path / "out/launch/hostfile")]
    exported = dict(argv[index + 1].split("=", 1) for index, part in enumerate(argv) if part == "-x")
    assert {key: exported.get(key) for key in RENDERED} == {key: quoted(value) for key, value in RENDERED.items()}
    assert (
        exported["ASTR_LAUNCHER"] == "openmpi"
        and exported["MASTER_ADDR"] == "localhost"
        and exported["MASTER_PORT"] == "29500"
    )
    assert "ASTR_TEST_STRAY" not in exported


def test_srun_gets_the_values_and_the_rendezvous(tmp_path, capsys, monkeypatch):
    argv = launch_with_fakes(tmp_path, capsys, monkeypatch, "slurm")
    assert argv[1:5] == ["-n", "4", "--nodes", "2"]
    export = next(part for part in argv if part.startswith("--export=ALL,"))
    exported = dict(item.split("=", 1) for item in export.removeprefix("--export=ALL,").split(","))
    expected_values = {
        key.replace("PUNCTUATION", "PUNCTUATION_UNUSED"): quoted(value) for key, value in RENDERED.items()
    }
    assert {key: exported.get(key) for key in expected_values} == expected_values
    assert exported["ASTR_LAUNCHER"] == "slurm" and "ASTR_TEST_STRAY" not in exported


# ---- rank side: launcher variables, node rank, report, preflight --------------------------------


def test_ranks_started_by_mpirun_or_srun_get_torch_variables_only_when_launch_marked_them():
    openmpi = {
        "ASTR_LAUNCHER": "openmpi",
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "16",
        "OMPI_COMM_WORLD_LOCAL_RANK": "5",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
    }
    assert rank_environment.prepare_rank_environment(openmpi) == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "LOCAL_SIZE": "8",
    }
    slurm = {
        "ASTR_LAUNCHER": "slurm",
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
    }
    assert rank_environment.prepare_rank_environment(slurm) == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "NODE_RANK": "1",
    }
    inside_sbatch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}  # a lone `python astrai/train.py` in a batch script
    assert rank_environment.prepare_rank_environment(inside_sbatch) == {} and "RANK" not in inside_sbatch
    already = {"ASTR_LAUNCHER": "slurm", "RANK": "3", "SLURM_PROCID": "9"}
    assert rank_environment.prepare_rank_environment(already) == {} and already["RANK"] == "3"


@pytest.mark.parametrize(
    "environ, rank, local_rank, world_size, node_rank",
    [
        ({"CROSS_RANK": "1", "LOCAL_SIZE": "8"}, 9, 1, 16, 1),  # DeepSpeed's launch
        ({"GROUP_RANK": "2"}, 17, 1, 24, 2),  # torchrun
        ({"LOCAL_SIZE": "8"}, 13, 5, 16, 1),  # derived: equal ranks per node
        ({}, 0, 0, 1, 0),
        ({}, 3, 0, 4, None),
    ],
)
def test_node_rank(environ, rank, local_rank, world_size, node_rank):
    assert preflight.node_rank_of(environ, rank, local_rank, world_size) == node_rank


def test_environment_at_exec_is_the_environment_the_process_started_with(monkeypatch):
    monkeypatch.setenv("ASTR_TEST_SET_LATER", "1")
    at_exec = preflight.environment_at_exec()
    assert at_exec is not None and "PATH" in at_exec and "ASTR_TEST_SET_LATER" not in at_exec


def facts(
    rank,
    node_rank,
    host,
    *,
    torch_version="2.13.0",
    deepspeed_version="0.19.8",
    kind="cpu",
    node_devices=0,
    local_rank=0,
    nccl=None,
    topology=None,
):
    return {
        "rank": rank,
        "node_rank": node_rank,
        "host": host,
        "local_rank": local_rank,
        "device_kind": kind,
        "node_devices": node_devices,
        "topology": topology,
        "versions": {"python": "3.11.9", "torch": torch_version, "deepspeed": deepspeed_version, "cuda": None},
        "communication_environment": nccl or {},
    }


def test_matching_ranks_pass_and_are_summarized():
    everyone = [
        facts(
            r,
            r // 2,
            f"node-{'ab'[r // 2]}",
            kind="NVIDIA H100",
            node_devices=2,
            local_rank=r % 2,
            nccl={"NCCL_DEBUG": "WARN"},
        )
        for r in range(4)
    ]
    summary = preflight.summarize(everyone)
    assert preflight.find_problems(summary, everyone, gpus_per_node=2) == []
    assert [(node["host"], node["ranks"]) for node in summary["nodes"]] == [("node-a", [0, 1]), ("node-b", [2, 3])]
    assert preflight.describe(summary)[:2] == [
        "4 ranks on 2 nodes (2 per node); python 3.11.9, torch 2.13.0, deepspeed 0.19.8",
        "node 0 node-a: ranks 0-1 on NVIDIA H100; 2 GPUs on the node",
    ]
    assert "NCCL_DEBUG: 'WARN' on ranks 0-3" in preflight.describe(summary)


def test_mismatches_are_named_with_their_ranks():
    everyone = [
        facts(0, 0, "node-a", kind="NVIDIA H100", node_devices=8),
        facts(1, 0, "node-a", local_rank=0, kind="NVIDIA H100", node_devices=8),
        facts(2, 1, "node-b", torch_version="2.12.1", node_devices=4),
        facts(3, 1, "node-b", local_rank=1, torch_version="2.12.1", node_devices=4),
    ]
    problems = preflight.find_problems(preflight.summarize(everyone), everyone, gpus_per_node=8)
    assert problems == [
        "ranks run different torch versions (2.12.1 on ranks 2-3; 2.13.0 on ranks 0-1): install the same torch on "
        "every node",
        "some ranks run on CPUs and others on GPUs (node 0 (node-a): NVIDIA H100; node 1 (node-b): cpu)",
        "node 1 (node-b) has 4 GPUs, infra.gpus_per_node says 8",
        "ranks 0-1 all claim local rank 0 of node 0: the launchers of the nodes disagree",
    ]


def test_a_deepspeed_version_mismatch_is_named_with_its_ranks():
    everyone = [
        facts(r, r // 2, f"node-{'ab'[r // 2]}", local_rank=r % 2, deepspeed_version="0.19.8" if r < 2 else "0.18.4")
        for r in range(4)
    ]
    summary = preflight.summarize(everyone)
    assert preflight.find_problems(summary, everyone, gpus_per_node=None) == [
        "ranks run different deepspeed versions (0.18.4 on ranks 2-3; 0.19.8 on ranks 0-1): install the same "
        "deepspeed on every node",
    ]
    assert "deepspeed 0.18.4/0.19.8" in preflight.describe(summary)[0]


TOPOLOGY = "\tGPU0\tGPU1\tNIC0\nGPU0\t X \tNV18\tPXB\nGPU1\tNV18\t X \tPXB\n"


def fake_nvidia_smi(folder: Path, script: str) -> Path:
    """An `nvidia-smi` first on PATH that logs its arguments to nvidia-smi.args and runs `script`."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    program = bin_dir / "nvidia-smi"
    program.write_text(f'#!/bin/sh\necho "$@" >> "{folder}/nvidia-smi.args"\n{script}\n')
    program.chmod(0o755)
    return bin_dir


def test_interconnect_topology_comes_from_nvidia_smi_and_joins_the_description(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(tmp_path, f"printf '{TOPOLOGY}'")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    matrix = preflight.interconnect_topology()
    assert matrix == TOPOLOGY and (tmp_path / "nvidia-smi.args").read_text() == "topo -m\n"
    everyone = [
        facts(0, 0, "node-a", kind="NVIDIA H100", node_devices=2, topology=matrix),
        facts(1, 0, "node-a", kind="NVIDIA H100", node_devices=2, local_rank=1),
    ]
    lines = preflight.describe(preflight.summarize(everyone))
    assert lines[-1] == "topology of node 0 node-a (nvidia-smi topo -m):\n" + matrix.rstrip()


def test_interconnect_topology_failures_are_reported_not_raised(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(
        tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver' >&2; exit 9"
    )
    monkeypatch.setenv("PATH", str(bin_dir))
    assert (
        preflight.interconnect_topology()
        == "nvidia-smi topo -m failed: NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert preflight.interconnect_topology() is None


def test_rank_ranges():
    assert preflight.rank_ranges([8, 0, 1, 2, 3, 10, 11]) == "0-3, 8, 10-11" and preflight.rank_ranges([4]) == "4"


def test_one_rank_writes_its_report_and_the_preflight(tmp_path, monkeypatch):
    from astrai.config import load_job

    config = write_job(tmp_path, ENVIRONMENT, "infra: {gpus_per_node: 8}\n")
    job = load_job(config)
    monkeypatch.setenv("ASTR_TEST_WORDS", "changed by someone")
    monkeypatch.delenv("ASTR_TEST_INT", raising=False)
    ranks = tmp_path / "out" / "ranks"
    ranks.mkdir(parents=True)
    (ranks / "rank_3.json").write_text("{}")  # from an earlier run with more ranks
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    report = preflight.write_rank_report(job, dist)
    assert sorted(path.name for path in ranks.iterdir()) == ["rank_0.json"]
    written = json.loads((ranks / "rank_0.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert (
        written["environment"]["ASTR_TEST_WORDS"] == "changed by someone"
        and written["environment"]["ASTR_TEST_INT"] is None
    )
    assert (
        written["rank"],
        written["node_rank"],
        written["world_size"],
        written["device"],
        written["joined_process_group"],
    ) == (0, 0, 1, "cpu", True)
    assert written["host"] == socket.gethostname() and written["pid"] == os.getpid()
    assert written["topology"] is None  # asked of nvidia-smi only on GPU ranks
    assert written["versions"]["torch"] == torch.__version__ and written["versions"]["deepspeed"]
    with pytest.raises(PreflightError, match="node 0 .* has 0 GPUs, infra.gpus_per_node says 8"):
        preflight.preflight_check(job, dist, report)
    assert json.loads((ranks / "preflight.json").read_text())["problems"] == [
        f"node 0 ({written['host']}) has 0 GPUs, infra.gpus_per_node says 8"
    ]


def test_before_the_rendezvous_the_report_comes_from_the_launcher_variables(tmp_path, monkeypatch):
    from astrai.config import load_job

    job = load_job(write_job(tmp_path, ENVIRONMENT))
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "CROSS_RANK": "1",
        "LOCAL_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
    }.items():
        monkeypatch.setenv(name, value)
    preflight.write_rank_report(job)
    written = json.loads((tmp_path / "out/ranks/rank_3.json").read_text())
    assert (written["rank"], written["world_size"], written["local_rank"], written["node_rank"]) == (3, 4, 1, 1)
    assert (written["joined_process_group"], written["rendezvous"], written["backend"]) == (
        False,
        "10.0.0.1:29511",
        "gloo",
    )


def test_the_example_multinode_job_validates_and_renders_cleanly():
    from astrai.config import load_job

    job = load_job(REPO / "configs/multinode_example.yaml", check_paths=False)
    assert (len(job.infra.nodes), job.infra.gpus_per_node) == (2, 8)
    values, warnings = launch.check_environment(job.runtime.environment, job.infra.launcher)
    assert values["NCCL_NVLS_ENABLE"] == "1" and warnings == []


def test_dry_run_stdout_is_the_command_alone_in_a_fresh_process(tmp_path):
    """`cmd=$(python -m astrai launch --dry-run ...)` must get the command and nothing else: the job checks
    import DeepSpeed, whose first import logs its accelerator choice on stdout (in this test process an
    earlier test has imported it already, so only a fresh process shows it)."""
    nodes = "infra:\n  launcher: pdsh\n  nodes: [{host: localhost, slots: 1}, {host: 127.0.0.1, slots: 1}]\n"
    config = write_job(tmp_path, nodes)
    finished = subprocess.run(
        [sys.executable, "-m", "astrai", "launch", "--config", config, "--dry-run"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("env DS_ENV_FILE="), finished.stdout
