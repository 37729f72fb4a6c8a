"""`runtime.environment` and the launcher's rank variables: the one renderer of a job's environment.

Every reader renders `runtime.environment` here, the same way: the launcher's env file
(astrai/launch/multinode.py), each rank at start (astrai/launch/rank_start.py, for astrai/train.py and
astrai/launch/preflight.py) and the rank report's record of it. The host-side wrappers
(scripts/docker/lib/job_yaml.py) mirror `render_environment` because hosts run them without AstrAI installed.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

LAUNCHER_VARIABLE = "ASTR_LAUNCHER"  # written by `python -m astrai launch` into the env file of openmpi/slurm jobs
# mpirun and srun start the trainer directly, with their own rank variables instead of torch's.
_LAUNCHER_RANK_VARIABLES = {
    "openmpi": {
        "RANK": "OMPI_COMM_WORLD_RANK",
        "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
        "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
        "LOCAL_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    "slurm": {
        "RANK": "SLURM_PROCID",
        "WORLD_SIZE": "SLURM_NTASKS",
        "LOCAL_RANK": "SLURM_LOCALID",
        "NODE_RANK": "SLURM_NODEID",
    },
}


def render_environment(environment: Mapping[str, Any]) -> dict[str, str]:
    """`runtime.environment` as strings: str() of each value, null as ''."""
    return {str(key): "" if value is None else str(value) for key, value in environment.items()}


def prepare_rank_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Before setup_distributed: give ranks started by mpirun or srun torch's RANK/WORLD_SIZE/LOCAL_RANK.

    Only when `python -m astrai launch` marked the job (ASTR_LAUNCHER in its env file): inside an sbatch
    script SLURM_PROCID=0 and SLURM_NTASKS=16 are set for a lone `python astrai/train.py` too, and
    adopting them there would make it wait forever for 15 ranks that never come. Returns what it set.
    """
    environ = os.environ if environ is None else environ
    names = _LAUNCHER_RANK_VARIABLES.get(environ.get(LAUNCHER_VARIABLE, ""))
    adopted = (
        {}
        if not names or "RANK" in environ
        else {ours: environ[theirs] for ours, theirs in names.items() if theirs in environ}
    )
    environ.update(adopted)
    _warn_if_no_device_for(environ)
    return adopted


def _warn_if_no_device_for(environ: Mapping[str, str]) -> None:
    """A hostfile that gives a node more slots than it has GPUs fails in torch.cuda.set_device with
    'invalid device ordinal'; say which host and why first (logging is not configured yet: stderr)."""
    import torch

    local_rank = int(environ.get("LOCAL_RANK", "0") or 0)
    if torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        print(
            f"astrai: host {socket.gethostname()}: local rank {local_rank} but only {torch.cuda.device_count()} CUDA "
            f"devices are visible (CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): the host "
            "list gives this node more slots than it has GPUs",
            file=sys.stderr,
        )


def apply_environment(environment: Mapping[str, Any]) -> None:
    """`runtime.environment` exported to this process (a rank): rendered by `render_environment`."""
    os.environ.update(render_environment(environment))
