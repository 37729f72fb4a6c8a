"""`python -m astrai launch`: start a job on one or many nodes through DeepSpeed's own launcher.

    python -m astrai launch --config job.yaml [--dry-run] [--check] [--node-rank K]
                            [--launcher-args ARGS] [--set key.path=value ...]

Before anything starts (one message and exit status 2 when something is wrong):
1. the job is loaded and validated with its overrides, exactly as every rank will load it;
2. the host list (`infra.nodes` or `infra.hostfile`) is checked: not empty, slots >= 1, no host twice,
   every host and the master address resolve, no loopback master for nodes on other machines, and
   the launcher's own needs (no_ssh: --node-rank; slurm: equal slots; the launcher program installed),
   and (pdsh, openmpi; not with --dry-run) every node answers `ssh -o BatchMode=yes host true` in bounded time;
3. an output_dir in use by a live job (its lock record, astrai/launch/output_lock.py) stops the launch (exit status 1);
4. `output_dir/launch/hostfile` (DeepSpeed's `host slots=N`) and `output_dir/launch/deepspeed_env`
   (the job's `runtime.environment`) are written.
Then `deepspeed ... astrai/train.py --config job.yaml [--set ...]` runs (astrai/launch/preflight.py with
--check), or with --dry-run its exact command line is printed on stdout.

How the environment reaches every node, in DeepSpeed 0.19.8 (deepspeed/launcher/runner.py):
- pdsh, openmpi, slurm: the runner reads `$DS_ENV_FILE` (default `.deepspeed_env`) in the home folder
  and in the current folder and exports each `KEY=value` line on every node. DS_ENV_FILE names the
  job's own file by absolute path, so both lookups find it and a stale ~/.deepspeed_env of another job
  is never read. The runner splits each line at the first '=', strips the value, and wraps it in double
  quotes itself when it holds anything but [\\w@%+=:,./-], so values are written unquoted; pdsh's
  remote shell still expands `$`, backquotes and backslashes inside those quotes: such values are refused.
- no_ssh: the runner starts the node's ranks itself and never reads the file, so the variables go
  into its own environment, which the ranks inherit.
astrai/train.py exports the same values again at start; what the launcher delivered shows as
`environment_at_exec` in each rank's report (output_dir/ranks/rank_<k>.json).

NCCL workarounds are opt-in per job: NCCL_* and TORCH_NCCL_* variables of the shell running `launch`
that the job does not list are removed from the launcher's environment (and named on stderr). Left
there, DeepSpeed's runner would export every NCCL_* to all nodes (on CUDA hosts: its EXPORT_ENVS plus
the accelerator's ['NCCL']), and with no_ssh the ranks would inherit them all.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.config import ConfigError
from astrai.launch.environment import LAUNCHER_VARIABLE, render_environment
from astrai.launch.output_lock import in_use_message, live_holder
from astrai.safe_write import write_file_atomic

ASTRAI_FOLDER = Path(__file__).resolve().parents[1]  # astrai/: the programs the launcher starts
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own hostfile grammar (runner._parse_hostfile)
NEEDS_QUOTES = re.compile(r"[^\w@%+=:,./-]")  # what DeepSpeed's MultiNodeRunner.add_export wraps in "..."
SHELL_ACTIVE = set('"$`\\')  # still expanded by a shell inside double quotes
VARIABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST_ONLY_PREFIXES = ("NCCL_", "TORCH_NCCL_")  # reach the ranks only when the job lists them
# pdsh and mpirun reach every node by ssh without a password; probe each one the same way first.
SSH_LAUNCHERS = ("pdsh", "openmpi")
SSH_PROBE = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5")
SSH_PROBE_TIMEOUT_S = 15.0
LAUNCHER_PROGRAMS = {"pdsh": ("pdsh",), "openmpi": ("mpirun", "ompi_info"), "slurm": ("srun", "sinfo"), "no_ssh": ()}
# Set for each rank by the launchers; one job-wide value would give every rank the same one.
PER_RANK_VARIABLES = {
    "MASTER_ADDR": "set infra.master_addr instead",
    "MASTER_PORT": "set infra.master_port instead",
    "CUDA_VISIBLE_DEVICES": "DeepSpeed sets it on each node from the node's slots",
    "DS_ENV_FILE": "`launch` points it at the job's own environment file",
    LAUNCHER_VARIABLE: "`launch` sets it from infra.launcher",
    **dict.fromkeys(
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "NODE_RANK", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE"),
        "the launcher sets it for each rank",
    ),
}


class LaunchError(ConfigError):
    """The host list, the launcher or the environment cannot work; raised before any rank starts."""


@dataclass(frozen=True)
class Node:
    host: str
    slots: int
    where: str  # where it was declared, for messages: "infra.nodes[1]" or "hosts.txt:3"


@dataclass
class LaunchPlan:
    command: list[str]  # argv of DeepSpeed's launcher
    environment: dict[str, str]  # added to the launcher's own environment
    nodes: list[Node]
    hostfile: Path
    env_file: Path
    env_file_values: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    # NCCL_*/TORCH_NCCL_* of this shell removed from the launcher's environment: the unlisted ones, and
    # the listed ones the env file carries (so the job's value is the only one DeepSpeed can export).
    unset: list[str] = field(default_factory=list)

    def launcher_environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """What the launcher process gets: `base` (this shell) less `unset`, plus `environment`."""
        return {**{key: value for key, value in base.items() if key not in self.unset}, **self.environment}

    @property
    def hostfile_text(self) -> str:
        return "".join(f"{node.host} slots={node.slots}\n" for node in self.nodes)

    @property
    def env_file_text(self) -> str:
        # No comment or blank line: DeepSpeed splits every line at '=' and fails on any other.
        return "".join(f"{key}={value}\n" for key, value in self.env_file_values.items())

    def shell_line(self) -> str:
        """The command as one copy-pasteable shell line, environment included."""
        unset = [part for key in self.unset for part in ("-u", key)]
        return shlex.join(
            ["env", *unset, *(f"{key}={value}" for key, value in self.environment.items()), *self.command]
        )


def read_hostfile(path: Path) -> list[Node]:
    """Nodes of a DeepSpeed hostfile: `host slots=N` lines; blank lines and # comments skipped."""
    nodes = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        match = HOSTFILE_LINE.search(text)
        if match is None:
            raise LaunchError(f"{path}:{number}: {text!r} is not a `host slots=N` line")
        nodes.append(Node(match[1], int(match[2]), f"{path}:{number}"))
    return nodes


def find_hostfile(name: str, config_path: str | Path) -> Path:
    """`infra.hostfile` as given (relative to the current folder), else relative to the job file."""
    candidates = [Path(name)] + ([] if Path(name).is_absolute() else [Path(config_path).resolve().parent / name])
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise LaunchError(
        f"{config_path}: infra.hostfile: {name!r} does not exist (looked at {', '.join(str(c) for c in candidates)})"
    )


def nodes_of(job, config_path: str | Path) -> list[Node]:
    """The job's nodes, checked: not empty, slots >= 1, each host once, usable names, launcher limits."""
    infra = job.infra
    if infra.hostfile is not None:
        path = find_hostfile(infra.hostfile, config_path)
        nodes, source = read_hostfile(path), str(path)
    elif infra.nodes is not None:
        nodes, source = (
            [Node(node.host, node.slots, f"infra.nodes[{index}]") for index, node in enumerate(infra.nodes)],
            "infra.nodes",
        )
    else:
        raise LaunchError(
            f"{config_path}: `launch` needs infra.nodes or infra.hostfile; on one machine run "
            "`deepspeed astrai/train.py --config <job>` instead (docs/guides/distributed.md)"
        )
    if not nodes:
        raise LaunchError(f"{config_path}: {source} lists no nodes")
    seen: dict[str, Node] = {}
    for node in nodes:
        if not node.host or re.search(r"[\s,@=]", node.host):
            raise LaunchError(f"{node.where}: {node.host!r} is not a host name (no spaces, commas, '@' or '=')")
        if node.slots < 1:
            raise LaunchError(f"{node.where}: {node.host} has slots={node.slots}; every node runs at least one rank")
        if node.host in seen:
            raise LaunchError(f"{node.where}: host {node.host} is listed twice (also at {seen[node.host].where})")
        if infra.gpus_per_node is not None and node.slots > infra.gpus_per_node:
            raise LaunchError(
                f"{node.where}: {node.host} has slots={node.slots}, more ranks than "
                f"infra.gpus_per_node={infra.gpus_per_node} devices"
            )
        seen[node.host] = node
    if infra.launcher == "slurm" and len({node.slots for node in nodes}) > 1:
        counts = ", ".join(f"{node.host}={node.slots}" for node in nodes)
        raise LaunchError(
            f"{config_path}: infra.launcher slurm starts the same number of ranks on every node (srun -n), but slots "
            f"differ: {counts}"
        )
    return nodes


def is_loopback(name: str) -> bool:
    """`localhost` or a literal loopback address (a name is not resolved: /etc/hosts often maps the
    machine's own name to 127.0.1.1 while the other nodes resolve it to the network address)."""
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return name.lower() in ("localhost", "localhost.localdomain")


def check_reachable(nodes: list[Node], master_addr: str, master_where: str) -> None:
    """Every host name resolves (getaddrinfo), and a loopback master only for nodes that all are this machine."""
    for name, where in [(node.host, node.where) for node in nodes] + [(master_addr, master_where)]:
        try:
            socket.getaddrinfo(name, None)
        except (socket.gaierror, UnicodeError) as error:
            raise LaunchError(
                f"{where}: host {name!r} does not resolve ({error}); fix the name or add it to DNS or /etc/hosts"
            ) from None
    remote = [node.host for node in nodes if not is_loopback(node.host)]
    if is_loopback(master_addr) and remote:
        raise LaunchError(
            f"{master_where}: {master_addr} is a loopback address, which {', '.join(remote)} cannot reach; give node "
            "0's network address"
        )


def check_environment(environment: Mapping[str, Any], launcher: str) -> tuple[dict[str, str], list[str]]:
    """`runtime.environment` rendered as astrai/train.py exports it, refusing what DeepSpeed's environment
    file would change on the way (see the module docstring); returns (values, warnings)."""
    values, warnings = render_environment(environment), []
    for (key, value), original in zip(values.items(), environment.values()):
        where = f"runtime.environment.{key}"
        if not VARIABLE_NAME.match(key):
            raise LaunchError(f"{where}: not a variable name (letters, digits and _, not starting with a digit)")
        if key in PER_RANK_VARIABLES:
            raise LaunchError(f"{where}: set for each rank by the launcher; {PER_RANK_VARIABLES[key]}")
        if "\n" in value or "\r" in value:
            raise LaunchError(
                f"{where}: a value of several lines cannot go through DeepSpeed's environment file (one KEY=value a "
                "line)"
            )
        if value != value.strip():
            raise LaunchError(f"{where}: {value!r} starts or ends with white space, which DeepSpeed's launcher strips")
        if SHELL_ACTIVE & set(value):
            raise LaunchError(
                f"{where}: {value!r} holds one of \" $ ` \\, which the nodes' shell expands inside the quotes "
                "DeepSpeed adds"
            )
        if launcher == "slurm" and "," in value:
            raise LaunchError(
                f"{where}: {value!r} holds a comma, which srun --export reads as the start of the next variable"
            )
        if isinstance(original, bool):
            warnings.append(
                f"{where}: YAML {str(original).lower()} is exported as {value!r}; NCCL and most C libraries want 1 or 0"
            )
        if launcher in ("openmpi", "slurm") and NEEDS_QUOTES.search(value):
            warnings.append(
                f"{where}: DeepSpeed hands {value!r} to {launcher} inside double quotes, which reach the ranks as "
                "part of the value; astrai/train.py exports the exact value again at start, so only programs that "
                "read it earlier see them"
            )
    return values, warnings


def host_only_variables(environ: Mapping[str, str]) -> list[str]:
    """NCCL_* / TORCH_NCCL_* set in `environ` (this shell): none passes on unless the job lists it."""
    return sorted(key for key in environ if key.startswith(HOST_ONLY_PREFIXES))


def deepspeed_program() -> str:
    """The `deepspeed` launcher of this Python environment (the one the ranks' Python belongs to)."""
    beside = Path(sys.executable).with_name("deepspeed")
    return str(beside) if beside.is_file() else shutil.which("deepspeed") or "deepspeed"


def deepspeed_command(
    job,
    nodes: list[Node],
    hostfile: Path,
    node_rank: int | None,
    script: Path,
    config: Path,
    overrides: list[str],
    launcher_args: str,
) -> list[str]:
    infra = job.infra
    command = [
        deepspeed_program(),
        "--hostfile",
        str(hostfile),
        "--master_addr",
        infra.master_addr or nodes[0].host,
        "--master_port",
        str(infra.master_port),
    ]
    if infra.launcher == "no_ssh":
        # Every node runs this same command with its own --node_rank; DeepSpeed starts that node's ranks locally.
        command += ["--no_ssh", "--node_rank", str(node_rank), "--num_nodes", str(len(nodes))]
        if len({node.slots for node in nodes}) == 1:
            command += ["--num_gpus", str(nodes[0].slots)]
    else:
        # --force_multi: a one-node job still goes through the launcher the job names, not a local start.
        command += ["--launcher", infra.launcher, "--force_multi"]
        if infra.launcher == "slurm":  # srun, not ssh, reaches the nodes; --num_nodes becomes srun --nodes
            command += ["--no_ssh_check", "--num_nodes", str(len(nodes))]
    if launcher_args:
        command += ["--launcher_args", launcher_args]
    command += [str(script), "--config", str(config)]
    for assignment in overrides:
        command += ["--set", assignment]
    return command


def plan_launch(
    job,
    config_path: str | Path,
    overrides: list[str],
    *,
    node_rank: int | None = None,
    check: bool = False,
    launcher_args: str = "",
) -> LaunchPlan:
    """Everything `launch` will do, checked, without writing or starting anything."""
    infra = job.infra
    nodes = nodes_of(job, config_path)
    if infra.launcher == "no_ssh":
        if node_rank is None:
            raise LaunchError(
                "infra.launcher no_ssh: give --node-rank K and run the same launch on every node (K = 0 .. "
                f"{len(nodes) - 1}, 0 on {nodes[0].host})"
            )
        if not 0 <= node_rank < len(nodes):
            raise LaunchError(f"--node-rank {node_rank}: the job has {len(nodes)} nodes (0 .. {len(nodes) - 1})")
    elif node_rank is not None:
        raise LaunchError(f"--node-rank is for infra.launcher no_ssh only; {infra.launcher} starts every node itself")
    master_addr = infra.master_addr or nodes[0].host
    check_reachable(
        nodes, master_addr, "infra.master_addr" if infra.master_addr else f"{nodes[0].where} (the master by default)"
    )
    values, warnings = check_environment(job.runtime.environment, infra.launcher)
    in_shell = host_only_variables(os.environ)
    dropped = [key for key in in_shell if key not in values]
    if dropped:
        warnings.append(
            f"not passed to the job: {', '.join(dropped)} (set in this shell, not in runtime.environment; NCCL "
            "workarounds are opt-in per job: list them there to use them)"
        )
    env_file_values = dict(values)
    if infra.launcher in ("openmpi", "slurm"):  # mpirun and srun start the trainer directly: it needs these from us
        env_file_values.update(
            {LAUNCHER_VARIABLE: infra.launcher, "MASTER_ADDR": master_addr, "MASTER_PORT": str(infra.master_port)}
        )
    folder = Path(job.output_dir).resolve() / "launch"
    environment = {"DS_ENV_FILE": str(folder / "deepspeed_env")}
    if infra.launcher == "no_ssh":
        environment.update(values)
    unset = [key for key in in_shell if key not in environment]
    script = ASTRAI_FOLDER / ("launch/preflight.py" if check else "train.py")
    command = deepspeed_command(
        job, nodes, folder / "hostfile", node_rank, script, Path(config_path).resolve(), list(overrides), launcher_args
    )
    return LaunchPlan(
        command, environment, nodes, folder / "hostfile", folder / "deepspeed_env", env_file_values, warnings, unset
    )


def require_programs(launcher: str) -> None:
    missing = [program for program in LAUNCHER_PROGRAMS[launcher] if shutil.which(program) is None]
    if missing:
        raise LaunchError(
            f"infra.launcher {launcher}: {', '.join(missing)} not found on this machine (DeepSpeed runs it to reach "
            "the nodes)"
        )
    if shutil.which(deepspeed_program()) is None:
        raise LaunchError("the `deepspeed` launcher is not installed in this Python environment")


def probe_nodes(nodes: list[Node]) -> None:
    """`ssh -o BatchMode=yes host true` on every node at once, each bounded: a node pdsh or mpirun cannot
    reach would otherwise start no ranks and leave the other nodes' ranks waiting in the rendezvous."""

    def failure(node: Node) -> str | None:
        try:
            done = subprocess.run(
                [*SSH_PROBE, node.host, "true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=SSH_PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return f"no answer within {SSH_PROBE_TIMEOUT_S:g} s"
        except OSError as error:  # no ssh client on this machine
            return str(error)
        return (
            None
            if done.returncode == 0
            else (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        )

    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        failures = [(node, reason) for node, reason in zip(nodes, pool.map(failure, nodes)) if reason]
    if failures:
        listing = "; ".join(f"{node.host} ({node.where}): {reason}" for node, reason in failures)
        raise LaunchError(f"not reachable by passwordless ssh, which the launcher uses to start the ranks: {listing}")


def write_launch_files(plan: LaunchPlan) -> None:
    """Atomically: with no_ssh every node writes the same files, maybe into one shared folder at once."""
    plan.hostfile.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((plan.hostfile, plan.hostfile_text), (plan.env_file, plan.env_file_text)):
        write_file_atomic(path, text)


def run(plan: LaunchPlan) -> int:
    process = subprocess.Popen(plan.command, env=plan.launcher_environment(os.environ))
    try:
        code = process.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the launcher too (same process group): let it stop its ranks
        code = process.wait()
    return code if code >= 0 else 128 - code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m astrai launch",
        description="Start a job on its nodes with DeepSpeed's launcher (docs/guides/distributed.md).",
    )
    parser.add_argument("--config", required=True, help="job YAML; infra.nodes or infra.hostfile name the nodes")
    parser.add_argument(
        "--dry-run", action="store_true", help="check and write the launch files, print the command, start nothing"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="start astrai/launch/preflight.py instead of training: every rank reports, versions and devices compared",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="K",
        help="this node's index (infra.launcher no_ssh only, then required)",
    )
    parser.add_argument(
        "--launcher-args",
        default="",
        metavar="ARGS",
        help="passed as DeepSpeed's --launcher_args (pdsh, mpirun or srun options)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a job key, here and on every rank; repeatable",
    )
    return parser


def launch_main(argv: list[str] | None = None) -> int:
    """Exit status: the launcher's (0 when every rank succeeded); 2 when the job or host list is wrong;
    1 when output_dir is in use."""
    args = build_parser().parse_args(argv)
    from astrai.launch.job_checks import load_and_check  # the very checks every rank runs on the job file

    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the command; DeepSpeed's import says things
            job = load_and_check(args.config, args.set)
        plan = plan_launch(
            job, args.config, args.set, node_rank=args.node_rank, check=args.check, launcher_args=args.launcher_args
        )
        if not args.dry_run:
            require_programs(job.infra.launcher)
            if job.infra.launcher in SSH_LAUNCHERS:  # slurm's srun and no_ssh need no ssh
                probe_nodes(plan.nodes)
        # no_ssh nodes 1.. run after node 0, whose own job may hold the lock already
        holder = None if args.node_rank else live_holder(job.output_dir)
        if holder is not None:  # checked before the launch files are written into its output_dir
            print(f"astrai launch: {in_use_message(job.output_dir, holder)}", file=sys.stderr)
            return 1
        write_launch_files(plan)
    except (ConfigError, OSError) as error:
        print(f"astrai launch: {error}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"astrai launch: warning: {warning}", file=sys.stderr)
    ranks = sum(node.slots for node in plan.nodes)
    print(
        f"astrai launch: {len(plan.nodes)} nodes, {ranks} ranks; {plan.hostfile}; {plan.env_file} "
        f"({len(plan.env_file_values)} variables)",
        file=sys.stderr,
    )
    if args.dry_run:
        print(plan.shell_line())
        return 0
    print(f"astrai launch: {plan.shell_line()}", file=sys.stderr, flush=True)
    return run(plan)


if __name__ == "__main__":
    sys.exit(launch_main())
