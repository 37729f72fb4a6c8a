"""Rank side of a (multi-node) start: the per-rank report and the preflight check.

Every rank, through astrai/launch/rank_start.py (astrai/train.py and this file's `main`):

    prepare_rank_environment()              # ranks started by mpirun/srun get RANK, WORLD_SIZE, LOCAL_RANK
    write_rank_report(job)                  # output_dir/ranks/rank_<global rank>.json, before the rendezvous
    dist = setup_distributed(...)
    preflight_check(job, dist, write_rank_report(job, dist))   # ONE all_gather_object; PreflightError

The report is written before the rendezvous and again before the first collective, so it exists even
when either hangs: it is the first thing to read when a multi-node job misbehaves. The check gathers
every rank's report and every rank reaches the same verdict from the same data, so a mismatch (torch or
deepspeed versions that differ between nodes, a node with fewer GPUs than `infra.gpus_per_node`) stops all ranks at once
instead of leaving some waiting in a collective.

`deepspeed astrai/launch/preflight.py --config job.yaml` runs only these steps: it is what
`python -m astrai launch --check` starts on every node. Never imports deepspeed (house rule: only
astrai/engine/ does); its version comes from the package metadata.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run by path: the repository root first, in place of astrai/launch/, whose
    # modules (environment, preflight, ...) would otherwise shadow top-level ones of the same name
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import glob
import json
import logging
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from astrai.errors import AstraiError
from astrai.launch.environment import render_environment
from astrai.safe_write import write_file_atomic

logger = logging.getLogger("astrai.preflight")

# Node index as set by DeepSpeed's launch (CROSS_RANK), torchrun (GROUP_RANK) and others (NODE_RANK).
_NODE_RANK_VARIABLES = ("CROSS_RANK", "GROUP_RANK", "NODE_RANK")
CHECKED_VERSIONS = ("torch", "deepspeed")  # ranks that differ here disagree on collectives and shard formats
TOPOLOGY_TIMEOUT_S = 15.0


class PreflightError(AstraiError, RuntimeError):
    """The ranks of a job do not match (versions, devices); the message names the nodes and ranks."""


def node_rank_of(environ: Mapping[str, str], rank: int, local_rank: int, world_size: int) -> int | None:
    """This rank's node index: from the launcher's variables, else derived from LOCAL_SIZE (equal ranks per node)."""
    for name in _NODE_RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    local_size = environ.get("LOCAL_SIZE") or environ.get("LOCAL_WORLD_SIZE") or ""
    if local_size.isdigit() and int(local_size) > 0:
        return (rank - local_rank) // int(local_size)
    return 0 if world_size == 1 else None


def environment_at_exec() -> dict[str, str] | None:
    """The environment this process was started with (Linux /proc/self/environ, which later os.environ
    changes do not touch): shows what the launcher delivered, before astrai/train.py re-exported the job's."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def communication_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL/CUDA settings in force: NCCL_*, TORCH_NCCL_*, CUDA_VISIBLE_DEVICES."""
    return {
        key: environ[key]
        for key in sorted(environ)
        if key.startswith(("NCCL_", "TORCH_NCCL_")) or key == "CUDA_VISIBLE_DEVICES"
    }


def package_versions() -> dict[str, str | None]:
    import torch

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": installed("deepspeed"),
        "cuda": torch.version.cuda,
        "transformers": installed("transformers"),
    }


def node_device_count() -> int:
    """GPUs of this node, not only those CUDA_VISIBLE_DEVICES shows this rank (DeepSpeed narrows it to the
    node's slots): the /dev/nvidia<N> device files (a container sees only its own), else torch's count."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return len(glob.glob("/dev/nvidia[0-9]*")) or torch.cuda.device_count()


def interconnect_topology() -> str | None:
    """`nvidia-smi topo -m` (NVLink/NVSwitch, PCIe, NIC affinity) when nvidia-smi is on PATH, else None;
    rank_facts asks only on GPU ranks."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        completed = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=TOPOLOGY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi topo -m failed: {error}"
    return completed.stdout if completed.returncode == 0 else f"nvidia-smi topo -m failed: {completed.stderr.strip()}"


def rank_facts(job, dist=None) -> dict[str, Any]:
    """Everything one rank knows about itself; no collective. `dist` is astrai.engine.DistInfo once the
    process group is joined; before (None), rank, world size and local rank come from the launcher."""
    import torch

    environ = os.environ
    if dist is None:
        rank, world_size, local_rank = (
            int(environ.get(name) or default) for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))
        )
        device, kind = (
            (f"cuda:{local_rank}", None) if torch.cuda.is_available() else ("cpu", "cpu")
        )  # no CUDA call before set_device
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    else:
        rank, world_size, local_rank, device, backend = (
            dist.rank,
            dist.world_size,
            dist.local_rank,
            str(dist.device),
            dist.backend,
        )
        kind = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else dist.device.type
    keys = list(render_environment(job.runtime.environment))
    at_exec = environment_at_exec()
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "node_rank": node_rank_of(environ, rank, local_rank, world_size),
        "joined_process_group": dist is not None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": device,
        "device_kind": kind,
        "visible_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "node_devices": node_device_count(),
        "backend": backend,
        "rendezvous": f"{environ.get('MASTER_ADDR', '?')}:{environ.get('MASTER_PORT', '?')}",
        "versions": package_versions(),
        "environment": {key: environ.get(key) for key in keys},
        "environment_at_exec": None if at_exec is None else {key: at_exec.get(key) for key in keys},
        "communication_environment": communication_environment(environ),
        # Once per node, on GPU hosts: a CPU host's nvidia-smi (drivers without devices) only fails.
        "topology": interconnect_topology()
        if dist is not None and local_rank == 0 and dist.device.type == "cuda"
        else None,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ranks_folder(job) -> Path:
    return Path(job.output_dir) / "ranks"


def write_rank_report(job, dist=None) -> dict[str, Any]:
    """Write output_dir/ranks/rank_<global rank>.json (atomically) and return it.

    Called twice: before setup_distributed (dist=None), so that a rendezvous that hangs still leaves
    every started rank's report behind (with `joined_process_group: false`), then once joined.
    """
    facts = rank_facts(job, dist)
    folder = ranks_folder(job)
    folder.mkdir(parents=True, exist_ok=True)
    if facts["rank"] == 0:  # reports of an earlier, larger run of this job would read as ranks of this one
        for stale in folder.glob("rank_*.json"):
            number = stale.stem.split("_", 1)[1]
            if number.isdigit() and int(number) >= facts["world_size"]:
                stale.unlink(missing_ok=True)
    _write_json(folder / f"rank_{facts['rank']}.json", facts)
    return facts


def _write_json(path: Path, value: Any) -> None:
    write_file_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _node_key(facts: Mapping[str, Any]) -> tuple:
    # Two simulated nodes on one machine share a host name; the node rank tells them apart.
    return (facts["node_rank"], "") if facts["node_rank"] is not None else (10**9, facts["host"])


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    if not ranks:
        return ""
    parts, ordered = [], sorted(ranks)
    start = previous = ordered[0]
    for rank in ordered[1:] + [None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ", ".join(parts)


def summarize(everyone: list[Mapping[str, Any]]) -> dict[str, Any]:
    """World size, nodes with their ranks and devices, versions and NCCL/CUDA settings by rank."""
    nodes: dict[tuple, list[Mapping[str, Any]]] = {}
    for facts in sorted(everyone, key=lambda item: item["rank"]):
        nodes.setdefault(_node_key(facts), []).append(facts)
    by_value: dict[str, dict[str, dict[str, list[int]]]] = {"versions": {}, "communication_environment": {}}
    for facts in everyone:
        for section, values in by_value.items():
            for name, value in facts[section].items():
                values.setdefault(name, {}).setdefault(str(value), []).append(facts["rank"])
    return {
        "world_size": len(everyone),
        "nodes": [
            {
                "node_rank": members[0]["node_rank"],
                "host": members[0]["host"],
                "ranks": [facts["rank"] for facts in members],
                "device_kinds": sorted({facts["device_kind"] for facts in members}),
                "node_devices": max(facts["node_devices"] for facts in members),
                "topology": next((facts["topology"] for facts in members if facts["topology"]), None),
            }
            for _, members in sorted(nodes.items(), key=lambda item: item[0])
        ],
        **{
            section: {name: {value: sorted(ranks) for value, ranks in seen.items()} for name, seen in values.items()}
            for section, values in by_value.items()
        },
    }


def find_problems(
    summary: Mapping[str, Any], everyone: list[Mapping[str, Any]], gpus_per_node: int | None
) -> list[str]:
    """Mismatches that would make the job fail later, less clearly (or hang); empty when all is well."""
    problems = []
    for name in CHECKED_VERSIONS:
        seen = summary["versions"].get(name, {})
        if len(seen) > 1:
            listing = "; ".join(f"{version} on ranks {rank_ranges(ranks)}" for version, ranks in sorted(seen.items()))
            problems.append(f"ranks run different {name} versions ({listing}): install the same {name} on every node")
    kinds = {"cpu" if kind == "cpu" else "gpu" for node in summary["nodes"] for kind in node["device_kinds"]}
    if len(kinds) > 1:
        listing = "; ".join(
            f"node {node['node_rank']} ({node['host']}): {', '.join(node['device_kinds'])}" for node in summary["nodes"]
        )
        problems.append(f"some ranks run on CPUs and others on GPUs ({listing})")
    for node in summary["nodes"]:
        if gpus_per_node is not None and node["node_devices"] < gpus_per_node:
            problems.append(
                f"node {node['node_rank']} ({node['host']}) has {node['node_devices']} GPUs, infra.gpus_per_node says "
                f"{gpus_per_node}"
            )
    places: dict[tuple, list[int]] = {}
    for facts in everyone:
        node = f"node {facts['node_rank']}" if facts["node_rank"] is not None else f"host {facts['host']}"
        places.setdefault((node, facts["local_rank"]), []).append(facts["rank"])
    for (node, local_rank), ranks in places.items():
        if len(ranks) > 1:
            problems.append(
                f"ranks {rank_ranges(ranks)} all claim local rank {local_rank} of {node}: the launchers of the nodes "
                "disagree"
            )
    return problems


def describe(summary: Mapping[str, Any]) -> list[str]:
    """Human lines of the summary (rank 0 logs them; `launch --check` shows them)."""
    nodes = summary["nodes"]
    per_node = sorted({len(node["ranks"]) for node in nodes})
    shown = {name: sorted(summary["versions"].get(name, {})) for name in ("python", *CHECKED_VERSIONS, "cuda")}
    versions = ", ".join(
        f"{name} {'/'.join(values)}" for name, values in shown.items() if values not in ([], ["None"])
    )  # no cuda on CPU hosts
    lines = [
        f"{summary['world_size']} ranks on {len(nodes)} nodes ({'/'.join(map(str, per_node))} per node); {versions}"
    ]
    for node in nodes:
        lines.append(
            f"node {node['node_rank']} {node['host']}: ranks {rank_ranges(node['ranks'])} on "
            f"{', '.join(node['device_kinds'])}; {node['node_devices']} GPUs on the node"
        )
    settings = summary["communication_environment"]
    if not settings:
        lines.append("NCCL/CUDA environment: none set")
    for name, seen in sorted(settings.items()):
        where = (
            ""
            if sum(len(ranks) for ranks in seen.values()) == summary["world_size"] and len(seen) == 1
            else " (ranks differ)"
        )
        lines.append(
            f"{name}{where}: "
            + "; ".join(f"{value!r} on ranks {rank_ranges(ranks)}" for value, ranks in sorted(seen.items()))
        )
    for node in nodes:
        if node["topology"]:
            lines.append(
                f"topology of node {node['node_rank']} {node['host']} (nvidia-smi topo "
                f"-m):\n{node['topology'].rstrip()}"
            )
    return lines


def preflight_check(job, dist, facts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Gather every rank's facts (one all_gather_object), log the summary on rank 0, write
    output_dir/ranks/preflight.json there, and raise PreflightError on every rank when they do not match."""
    from astrai.engine import all_gather_objects

    everyone = all_gather_objects(dict(facts) if facts is not None else rank_facts(job, dist))
    summary = summarize(everyone)
    problems = find_problems(summary, everyone, job.infra.gpus_per_node)
    if dist.is_main:
        _write_json(ranks_folder(job) / "preflight.json", {**summary, "problems": problems})
        for line in describe(summary):
            logger.info("preflight: %s", line)
    if problems:
        raise PreflightError("preflight failed:\n  " + "\n  ".join(problems))
    return summary


def main(argv: list[str] | None = None) -> int:
    """`deepspeed astrai/launch/preflight.py --config job.yaml [--set k=v ...]`: every rank reports and checks,
    then exits."""
    parser = argparse.ArgumentParser(
        prog="astrai/launch/preflight.py", description="Report every rank and check that they match; trains nothing."
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from astrai.config import ConfigError, load_job
    from astrai.versions import VersionError, check_versions

    try:
        check_versions()  # what astrai/train.py refuses, this refuses first
    except VersionError as error:
        print(f"astrai preflight: {error}", file=sys.stderr)
        return 1
    from astrai.launch.launcher_watch import watch_launchers

    watch_launchers()
    try:
        job = load_job(args.config, args.set)  # with its paths: the data must be there on every node
    except ConfigError as error:
        print(f"astrai preflight: {error}", file=sys.stderr)
        return 2
    from astrai.launch.rank_start import RankStart

    start = RankStart(job, args.config, "INFO", prog="astrai preflight")
    if (code := start.open()) is not None:
        return code
    try:
        start.agree_on_lock()
        summary = start.preflight()
    # AstraiError, not PreflightError: run by path, this file is __main__, and rank_start raises the
    # PreflightError of astrai.launch.preflight, another class object than this module's.
    except AstraiError as error:  # PreflightError, OutputDirLockedError
        logger.error("%s", error)
        return 1
    finally:
        start.close()
    if start.dist.is_main:
        print(
            f"preflight ok: {summary['world_size']} ranks on {len(summary['nodes'])} nodes; reports in "
            f"{ranks_folder(job)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
