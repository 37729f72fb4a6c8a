"""The job's process group: init with the job's timeout (DeepSpeed's own ZeRO group included), threads
per rank, the few collectives the trainer makes, teardown, and per-rank log lines."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from astrai.errors import AstraiError

logger = logging.getLogger("astrai.engine")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # Ulysses (engine/sequence_parallel.py): consecutive ranks share each sequence; the data order, sample counts
    # and loss units are those of the data-parallel ranks (rank // sp of world // sp).
    sequence_parallel_size: int = 1
    sequence_group: Any = None  # the rank's sequence-parallel process group (None without it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each see their own rows: the world size over the sequence-parallel size."""
        return self.world_size // self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.sequence_parallel_size

    @property
    def sequence_parallel_rank(self) -> int:
        """This rank's place in its sequence's group: which cut of every packed row it holds."""
        return self.rank % self.sequence_parallel_size


class RendezvousError(AstraiError, RuntimeError):
    """The ranks could not meet: the launcher's rendezvous port is taken; the message names it and the fix."""


def loopback_interface() -> str | None:
    """The loopback network interface's name (`lo` on Linux, `lo0` on macOS), or None."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _init_single_rank(backend: str, timeout_s: float) -> None:
    """`python astrai/train.py` without a launcher: a process group of one over an in-memory store, so
    the run opens no rendezvous port (a TCP store listens on every interface), and gloo's (or NCCL's)
    own sockets are bound to the loopback interface, unless the job names another."""
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", interface)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))


def _port_in_use(error: BaseException) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def setup_distributed(timeout_s: float) -> DistInfo:
    """Join (or, without a launcher, create) the job's process group: nccl on GPUs, gloo on CPUs."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # `python astrai/train.py` without a launcher: one rank (or a process that made one before: no MASTER_ADDR).
    single_rank = "RANK" not in os.environ or (os.environ.get("WORLD_SIZE") == "1" and "MASTER_ADDR" not in os.environ)
    if single_rank:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
    else:
        skip_shared_memory_allreduce()
    if single_rank and not dist.is_initialized():
        _init_single_rank(backend, timeout_s)
    try:
        # With the group already made (one rank), DeepSpeed only adopts it.
        deepspeed.init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s), verbose=False
        )
    except RuntimeError as error:  # torch's DistNetworkError is one
        if not _port_in_use(error):
            raise
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise RendezvousError(
            f"rendezvous port {address} is already in use (another job or a leftover rank holds it): start the "
            "launcher with another port, e.g. `deepspeed --master_port 29511 astrai/train.py ...` "
            "(infra.master_port for `python -m astrai launch`)"
        ) from None
    _bound_deepspeed_world_group(timeout_s)
    device = torch.device(get_accelerator().device_name(local_rank)) if on_gpu else torch.device("cpu")
    pin_threads()
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


SHARED_MEMORY_OP = "deepspeed_shm_comm"


def skip_shared_memory_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from building and starting its shared-memory all-reduce.

    At `init_distributed` on a CPU, DeepSpeed JIT-compiles that op (tens of seconds the first time,
    under a file lock that a killed build leaves behind, so that every later launch waits on it
    forever) and each rank maps a 69 MB segment in /dev/shm named after MASTER_PORT that no one ever
    unlinks: every launch leaked 69 MB of RAM per rank until reboot, and a machine that ran the test
    suite a few dozen times ran out of memory. The op serves only `inference_all_reduce` (tensor-parallel
    inference), which training never calls; its collectives go through torch.distributed either way."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False  # the one dict DeepSpeed consults before building


def pin_threads() -> int:
    """Split this node's cores between its ranks (unless OMP_NUM_THREADS says otherwise): two
    ranks each using every core oversubscribe the CPU and slow both."""
    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
        reason = "OMP_NUM_THREADS"
    else:
        local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
        threads = max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))
        reason = f"{len(os.sched_getaffinity(0))} cores / {local_ranks} local ranks"
    torch.set_num_threads(threads)
    logger.info("intra-op threads per rank: %d (%s)", threads, reason)
    return threads


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sum each Python number over all ranks in one float64 all-reduce (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(value) for value in values]
    tensor = torch.tensor([float(value) for value in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a Python number over all ranks (identity on one process)."""
    return all_reduce_sums([value], device)[0]


def all_reduce_maxes(values: list[int], device: torch.device) -> list[int]:
    """Each integer's largest value over all ranks, in one all-reduce (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return [int(value) for value in values]
    tensor = torch.tensor([int(value) for value in values], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(value) for value in tensor.tolist()]


def all_gather_objects(value: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _bound_deepspeed_world_group(timeout_s: float) -> None:
    """DeepSpeed runs its ZeRO collectives (gathers, reduce-scatters) on its own clone of the world
    group, made with torch's default timeout (30 min on gloo, 10 on NCCL), not the job's. Make that
    clone here with `runtime.dist_timeout_s`, so a hung rank fails those collectives in bounded time too."""
    import deepspeed.utils.groups as ds_groups

    if ds_groups._WORLD_GROUP is None:
        ds_groups._WORLD_GROUP = dist.new_group(
            ranks=list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s)
        )


class CollectiveStalledError(AstraiError, RuntimeError):
    """A collective outside the checkpoint saves did not complete: a rank died, hung or lags elsewhere."""


def shutdown_distributed() -> None:
    import deepspeed.utils.groups as ds_groups

    if dist.is_initialized():
        dist.destroy_process_group()
    ds_groups._WORLD_GROUP = None  # destroyed with the rest; a later setup makes a new one


def set_log_format(rank: int, level: str) -> None:
    """Every line says its rank; ranks other than 0 log warnings and errors only, unless DEBUG."""
    chosen = getattr(logging, level.upper(), logging.INFO)
    if rank != 0 and chosen > logging.DEBUG:
        chosen = max(chosen, logging.WARNING)
    logging.basicConfig(
        level=chosen, format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    # DeepSpeed's own logger is chatty at INFO on every rank.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
