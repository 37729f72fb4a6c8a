"""The only module that knows DeepSpeed: distributed init, the DeepSpeed config, and engines.

Everything else gets an `Engine`: forward, backward, step, module, save, load. A job may hold
several engines (the PPO policy and critic), each built by `make_engine` with its own optimizer,
LR schedule and clipping.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger("astrai.engine")

DS_TAG = "state"  # DeepSpeed tag folder inside each engine's checkpoint part
PARAMETER_NAMES_KEY = "astrai_parameter_names"  # in ZeRO-0 model_states files: parameter names per optimizer group


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def setup_distributed(timeout_s: float) -> DistInfo:
    """Join (or, without a launcher, create) the job's process group: nccl on GPUs, gloo on CPUs."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:  # `python astrai/train.py` without the launcher: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s), verbose=False)
    _bound_deepspeed_world_group(timeout_s)
    device = torch.device(get_accelerator().device_name(local_rank)) if on_gpu else torch.device("cpu")
    pin_threads()
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


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


def effective_zero_stage(requested: int, world_size: int, offloaded: bool, keep: bool) -> int:
    """ZeRO-1/2 on a single rank partition over one process: all cost, no memory saved. Run
    stage 0 there unless offload needs ZeRO or the job keeps the stage (`deepspeed.single_rank_stage0: false`)."""
    if world_size == 1 and requested in (1, 2) and not offloaded and not keep:
        logger.info("one rank: ZeRO-%d partitions nothing here, running ZeRO-0 (set deepspeed.single_rank_stage0: false to keep it)", requested)
        return 0
    return requested


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    """Sum a Python number over all ranks (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


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
        ds_groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s))


class CollectiveStalledError(RuntimeError):
    """A collective outside the checkpoint saves did not complete: a rank died, hung or lags elsewhere."""


def shutdown_distributed() -> None:
    import deepspeed.utils.groups as ds_groups

    if dist.is_initialized():
        dist.destroy_process_group()
    ds_groups._WORLD_GROUP = None  # destroyed with the rest; a later setup makes a new one


def deep_merge(base: dict, extra: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def resolve_precision(dtype: str) -> str:
    """`auto` is bf16 on a GPU that supports it, fp32 elsewhere (CPU fp16 and bf16 are slow or absent)."""
    if dtype != "auto":
        return dtype
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def build_ds_config(
    section,
    *,
    template_path: Path | None,
    micro_batch_size: int,
    grad_accum_steps: int,
    max_grad_norm: float | None,
    precision: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    zero_stage: int | None = None,
    world_size: int | None = None,
) -> dict:
    """Template (if any) <- job settings <- `deepspeed.overrides`. The result is what DeepSpeed sees."""
    config: dict = json.loads(template_path.read_text()) if template_path else {}
    zero = config.setdefault("zero_optimization", {})
    stage = zero_stage if zero_stage is not None else section.zero_stage
    if stage is not None:
        zero["stage"] = stage
    zero.setdefault("stage", 0)
    for key, value in (("offload_optimizer", section.offload_optimizer), ("offload_param", section.offload_param)):
        if value is not None:
            zero[key] = {"device": value} if value != "none" else {"device": "none"}
    config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=grad_accum_steps,
        gradient_clipping=max_grad_norm or 0.0,
        steps_per_print=10**9,
        wall_clock_breakdown=False,
    )
    config.pop("train_batch_size", None)  # derived by DeepSpeed from micro x accumulation x world
    config["bf16"] = {"enabled": precision == "bf16"}
    config["fp16"] = {"enabled": precision == "fp16", "loss_scale": 0} if precision == "fp16" else {"enabled": False}
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if world_size is not None:
        any_offload = offloaded or zero.get("offload_param", {}).get("device", "none") not in ("none", None)
        zero["stage"] = effective_zero_stage(zero["stage"], world_size, any_offload, keep=not section.single_rank_stage0)
    implementation = section.optimizer
    if implementation == "auto":
        implementation = "cpu_adam" if offloaded else ("fused" if torch.cuda.is_available() else "torch")
    params: dict[str, Any] = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": 0.0}
    if implementation == "torch":
        params["torch_adam"] = True  # fused Adam is CUDA-only
    elif implementation == "cpu_adam" and not offloaded:
        raise ValueError("deepspeed.optimizer: cpu_adam needs deepspeed.offload_optimizer: cpu")
    config["optimizer"] = {"type": "AdamW", "params": params}
    return deep_merge(config, section.overrides)


def lr_lambda(total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak LR for the update that follows `completed` optimizer steps.

    Update u = completed + 1 uses u / warmup during warmup (the first update is not wasted at lr 0),
    then decays to `min_lr_ratio` at the last step.
    """

    def multiplier(completed: int) -> float:
        update = completed + 1
        if update <= warmup_steps:
            return update / warmup_steps
        if schedule == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (update - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return multiplier


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) keep their scale."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            # A parameter loaded partitioned (ZeRO-3 zero3_init) is a flat local shard: its real shape is ds_shape.
            shape = getattr(parameter, "ds_shape", parameter.shape)
            (decay if len(shape) >= 2 else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Engine:
    """A trainable model in its own DeepSpeed engine; the interface strategies use."""

    def __init__(self, ds_engine, ds_config: dict):
        self._engine = ds_engine
        self.ds_config = ds_config
        self._stage0_grad_norm: float | None = None
        if self.zero_stage == 0:
            # Without ZeRO (fp32), DeepSpeed clips with its clip_grad_norm_ and drops the norm it returns
            # (get_global_grad_norm() stays None). Keep that norm instead of a second pass over every
            # gradient (~1.3% of a step of the benchmark's 8.4M Llama on a CPU).
            ds_engine.clip_fp32_gradients = self._clip_and_keep_norm

    def _clip_and_keep_norm(self) -> None:
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self._engine
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        self._stage0_grad_norm = float(norm)

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def precision(self) -> str:
        """`bf16`, `fp16` or `fp32`: the training dtype, as recorded in checkpoint manifests."""
        if self.ds_config["bf16"]["enabled"]:
            return "bf16"
        return "fp16" if self.ds_config.get("fp16", {}).get("enabled") else "fp32"

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> None:
        """Call after every micro-batch; DeepSpeed updates on the accumulation boundary."""
        if self.zero_stage == 0 and not self._engine.gradient_clipping() > 0 and self._engine.is_gradient_accumulation_boundary():
            # No clipping, so DeepSpeed computes no norm: take it from the reduced gradients.
            gradients = [p.grad for p in self.module.parameters() if p.grad is not None]
            self._stage0_grad_norm = float(torch.nn.utils.get_total_norm(gradients)) if gradients else None
        self._engine.step()

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    @property
    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    @property
    def global_steps(self) -> int:
        return int(self._engine.global_steps)

    @property
    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        if norm is None and self.zero_stage == 0:
            norm = self._stage0_grad_norm
        return None if norm is None else float(norm)

    def save(self, folder: Path) -> None:
        """DeepSpeed's own files (every rank's shards) under `folder`; no `latest` file (the publisher
        decides what is published). ZeRO-0 files do not name the optimizer's parameters (ZeRO files
        do): their names per optimizer group are added, so a topology change can read them."""
        names = self._parameter_names_by_group() if self.zero_stage == 0 else None
        client_state = {PARAMETER_NAMES_KEY: names} if names else {}
        self._engine.save_checkpoint(str(folder), tag=DS_TAG, client_state=client_state, save_latest=False)

    def _parameter_names_by_group(self) -> list[list[str]] | None:
        """Names of the module's parameters per optimizer group, in the optimizer's order (ZeRO-0)."""
        optimizer = self._engine.optimizer
        names = {id(parameter): name for name, parameter in self.module.named_parameters()}
        # bf16/fp16 ZeRO-0 wraps the torch optimizer (its groups hold fp32 copies); `fp16_groups` are the module's.
        groups = getattr(optimizer, "fp16_groups", None) or [group["params"] for group in getattr(optimizer, "param_groups", None) or []]
        if not groups or not all(id(parameter) in names for group in groups for parameter in group):
            return None
        return [[names[id(parameter)] for parameter in group] for group in groups]

    def load(self, folder: Path, *, with_optimizer: bool = True) -> None:
        tag = DS_TAG if (Path(folder) / DS_TAG).is_dir() else None  # None: a plain DeepSpeed dir with `latest`
        path, _ = self._engine.load_checkpoint(
            str(folder), tag=tag, load_optimizer_states=with_optimizer, load_lr_scheduler_states=with_optimizer
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {folder}")

    def load_full_state(self, source) -> None:
        """Set weights, Adam moments and step, LR schedule and step counters from full (unpartitioned)
        fp32 tensors, whatever this engine's ZeRO stage and world size: the load side of a topology change.

        `source` (a `portable.PortablePart`): `.names` (trainable parameters), `.tensor(key, name)` the
        full fp32 tensor of `key` ("fp32", "exp_avg", "exp_avg_sq") shaped like the parameter, and `.info`
        (`optimizer_step`, `lr_scheduler` state, `global_steps`, `global_samples`, `skipped_steps`).
        Every rank calls it. DeepSpeed's universal loader is a ZeRO-optimizer feature (nothing loads into
        ZeRO-0), so `portable.fill_*` fill each layout, as that loader does for the ones it knows.
        """
        named = {name: parameter for name, parameter in self.module.named_parameters() if parameter.requires_grad}
        missing, unknown = sorted(set(named) - set(source.names)), sorted(set(source.names) - set(named))
        if missing or unknown:
            raise ValueError(f"the checkpoint's parameters differ from the model's: missing {missing[:5]}, unknown {unknown[:5]}")
        from astrai.portable import fill_flat_partitions, fill_plain, fill_wrapped, fill_zero3

        optimizer, step = self._engine.optimizer, source.info.optimizer_step
        if self.zero_stage == 3:
            fill_zero3(optimizer, named, source, step)
        elif any(hasattr(parameter, "_hp_mapping") for parameter in named.values()):  # ZeRO-1/2, bf16 optimizer
            fill_flat_partitions(optimizer, named, source, step)
        elif hasattr(optimizer, "fp16_groups"):  # ZeRO-0 in bf16/fp16: DeepSpeed's FP16_Optimizer
            fill_wrapped(optimizer, named, source, step)
        elif isinstance(optimizer, torch.optim.Optimizer):  # ZeRO-0 in fp32: the optimizer holds the module's parameters
            fill_plain(optimizer, named, source, step)
        else:
            raise ValueError(f"cannot load a full state into a {type(optimizer).__name__} (ZeRO-{self.zero_stage})")
        info, scheduler = source.info, self._engine.lr_scheduler
        if info.lr_scheduler is not None and scheduler is not None:
            scheduler.load_state_dict(dict(info.lr_scheduler))
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr  # load_state_dict restores the schedule's position, not the optimizer's current lr
        self._engine.global_steps, self._engine.global_samples = info.global_steps, info.global_samples
        self._engine.skipped_steps = info.skipped_steps

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Full parameters on every rank for the block (ZeRO-3 gathers once; other stages hold them already)."""
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield
        else:
            yield


    @contextlib.contextmanager
    def generation_module(self, zero3_mode: str = "copy"):
        """The module to sample from with full weights, for the block.

        ZeRO-0/1/2: the module itself. ZeRO-3 `copy`: a plain (hook-free) module of the same class,
        allocated for the block and filled one gathered parameter at a time, so no DeepSpeed hook runs
        per token and the extra memory peaks at one full copy plus one parameter (freed afterwards).
        `gather`: the partitioned module inside one gather of every parameter (DeepSpeed's hooks still
        run at every forward, and every forward is a collective: callers pass synced_gpus). On a CPU
        `copy` samples ~5x faster (benchmarks/rollout_speed.py)."""
        if self.zero_stage != 3:
            yield self.module
        elif zero3_mode == "gather":
            with self.gathered_parameters():
                yield self.module
        else:
            plain = self._filled_plain_copy()
            try:
                yield plain
            finally:
                plain.to_empty(device="meta")  # free the copy's storage until the next rollout

    def _filled_plain_copy(self) -> torch.nn.Module:
        import deepspeed

        module = self.module
        if getattr(self, "_plain", None) is None:
            with torch.device("meta"):
                self._plain = type(module)(copy.deepcopy(module.config)).to(module.dtype)
            self._plain.tie_weights()  # as the engine's module, so the copy holds one tensor per tied group
            self._plain.eval()
        plain = self._plain.to_empty(device=self.device)
        targets = dict(plain.named_parameters())
        # Every name, tied ones included (lm_head.weight and embed_tokens.weight): whether the copy
        # ties them or not, each of its parameters gets its value.
        for name, parameter in module.named_parameters(remove_duplicate=False):
            try:
                with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
                    if name in targets:
                        targets.pop(name).data.copy_(parameter.data)
            except RuntimeError as error:  # torch's timeout or a peer's closed connection
                plain.to_empty(device="meta")
                raise CollectiveStalledError(
                    f"rollout weight sync: the ZeRO-3 all-gather of {name} did not complete on rank {dist.get_rank()} "
                    f"within runtime.dist_timeout_s: another rank died, hung, or is still busy elsewhere ({type(error).__name__}: {error})"
                ) from error
        if targets:
            raise RuntimeError(f"generation copy: parameters {sorted(targets)[:3]} have no counterpart in the engine's module")
        plain_buffers = dict(plain.named_buffers())
        for name, buffer in module.named_buffers():  # not partitioned by ZeRO-3 (e.g. rotary frequencies)
            plain_buffers[name].copy_(buffer)
        return plain


def consolidated_state_dict(engine_folder: str | Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from an engine's checkpoint folder written under any ZeRO stage and any
    number of ranks, on one CPU process (DeepSpeed's own zero_to_fp32 logic; no ranks needed)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = Path(engine_folder)
    tag = DS_TAG if (folder / DS_TAG).is_dir() else None
    tag_name = tag or ((folder / "latest").read_text().strip() if (folder / "latest").is_file() else None)
    shards = folder / tag_name if tag_name else folder
    if not list(shards.glob("*optim_states.pt")) and (shards / "mp_rank_00_model_states.pt").is_file():
        # ZeRO-0 keeps the whole module in one file; there are no partitions to merge.
        states = torch.load(shards / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {name: tensor.float() for name, tensor in states["module"].items()}
    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)


def make_engine(model: torch.nn.Module, ds_config: dict, *, weight_decay: float, schedule: Callable[[int], float]) -> Engine:
    """Wrap one model in its own engine, optimizer (from `ds_config`) and LR schedule."""
    import deepspeed

    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, weight_decay),
        config=ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        dist_init_required=False,
    )
    if ds_engine.zero_optimization_stage() == 0 and dist.get_world_size() == 1:
        # An all-reduce over one rank changes nothing and copies every gradient twice (~2% of a step
        # on a CPU, benchmarks/trainer_overhead.py `ds_z0_noreduce_w1`).
        ds_engine.enable_backward_allreduce = False
    return Engine(ds_engine, ds_config)


class FrozenEngine:
    """A model that is only ever evaluated (the DPO/RL reference): no optimizer, no gradients.
    Under ZeRO-3 its parameters are partitioned like the policy's, so memory stays per-rank."""

    def __init__(self, ds_engine, ds_config: dict):
        self._engine = ds_engine
        self.ds_config = ds_config
        self._engine.eval()

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)


def make_frozen_engine(model: torch.nn.Module, trainable_config: dict) -> FrozenEngine:
    """Wrap an inference-only model with the precision and (ZeRO-3 or not) sharding of `trainable_config`."""
    import deepspeed

    stage = 3 if trainable_config["zero_optimization"]["stage"] == 3 else 0
    config = {
        "train_micro_batch_size_per_gpu": trainable_config["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": trainable_config["gradient_accumulation_steps"],
        "zero_optimization": {"stage": stage},
        "bf16": trainable_config["bf16"],
        "fp16": trainable_config["fp16"],
        "steps_per_print": 10**9,
    }
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    ds_engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return FrozenEngine(ds_engine, config)


@contextlib.contextmanager
def zero3_loading(ds_config: dict, enabled: bool):
    """While active, `from_pretrained` loads weights already partitioned across ranks (ZeRO-3)."""
    if not enabled or ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    config = copy.deepcopy(ds_config)
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * max(
        1, dist.get_world_size() if dist.is_initialized() else 1
    )
    keep_alive = HfDeepSpeedConfig(config)  # transformers reads it through a weak reference
    try:
        yield
    finally:
        del keep_alive


def set_log_format(rank: int, level: str) -> None:
    """Every line says its rank; ranks other than 0 log warnings and errors only, unless DEBUG."""
    chosen = getattr(logging, level.upper(), logging.INFO)
    if rank != 0 and chosen > logging.DEBUG:
        chosen = max(chosen, logging.WARNING)
    logging.basicConfig(level=chosen, format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # DeepSpeed's own logger is chatty at INFO on every rank.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
