"""The `infra` section: the host side of a job, never read by the training loop.

Two owners share it. The node keys (nodes, hostfile, master_addr, master_port, launcher, gpus_per_node) are
read by `python -m astrai launch` and the preflight, and validated here. The container keys (job_name, data,
model, checkpoint_dir, gpu, image, shm_size) are read by the docker wrappers (scripts/train.sh, serve.sh),
which validate them on the host before any container starts (scripts/docker/train_runtime.py, which runs
without AstrAI installed): here they are accepted as given, so a typo of a key still fails, but a value is
the wrappers' to judge.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from astrai.config.sections.base import Section

WRAPPERS = "Docker wrappers: "


class NodeConfig(Section):
    host: str = Field(..., description="Host name or address of a node.")
    slots: int = Field(..., ge=1, description="Ranks (GPUs) to run on that node.")


class InfraConfig(Section):
    """Host side (containers, GPUs, nodes): read by the wrappers and `python -m astrai launch`, not the trainer."""

    job_name: Any = Field(None, description=WRAPPERS + "name of the job (containers, logs).")
    data: Any = Field(None, description=WRAPPERS + "host folder mounted read-only as the container's data folder.")
    model: Any = Field(None, description=WRAPPERS + "host folder of models mounted into the container.")
    checkpoint_dir: Any = Field(
        None, description=WRAPPERS + "host folder mounted as the container's output folder (checkpoints, metrics)."
    )
    gpu: Any = Field(
        None,
        description=WRAPPERS + "which GPUs of the host the job uses: `{devices, count}`. `devices`: `all` "
        "(CUDA_VISIBLE_DEVICES left unset, the default) or a list like [0, 1, 2, 3]; `count`: ranks to start on the "
        "host (default: the number of listed devices, or every GPU).",
    )
    image: Any = Field(None, description=WRAPPERS + "container image the trainer runs in (default: astrai:latest).")
    shm_size: Any = Field(
        None,
        description=WRAPPERS + "shared memory of the container (NCCL and data loaders need plenty; default: 16g).",
    )
    nodes: list[NodeConfig] | None = Field(None, description="Nodes of a multi-node job (exclusive with `hostfile`).")
    hostfile: str | None = Field(None, description="A DeepSpeed hostfile (`host slots=N` lines) instead of `nodes`.")
    master_addr: str | None = Field(None, description="Address of node 0 for the rendezvous (default: the first node).")
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the master node.")
    launcher: Literal["pdsh", "openmpi", "slurm", "no_ssh"] = Field(
        "pdsh", description="How DeepSpeed's launcher reaches the nodes."
    )
    gpus_per_node: int | None = Field(None, ge=1, description="Devices each node must have (checked by the preflight).")

    @model_validator(mode="after")
    def _one_host_list(self) -> InfraConfig:
        if self.nodes is not None and self.hostfile is not None:
            raise ValueError("give at most one of `infra.nodes` or `infra.hostfile`")
        return self
