"""The DeepSpeed config of one engine (template + job settings), its LR schedule and weight-decay groups."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger("astrai.engine")


def effective_zero_stage(requested: int, world_size: int, offloaded: bool, keep: bool) -> int:
    """ZeRO-1/2 on a single rank partition over one process: all cost, no memory saved. Run
    stage 0 there unless offload needs ZeRO or the job keeps the stage (`deepspeed.single_rank_stage0: false`)."""
    if world_size == 1 and requested in (1, 2) and not offloaded and not keep:
        logger.info("one rank: ZeRO-%d partitions nothing here, running ZeRO-0 (set deepspeed.single_rank_stage0: false to keep it)", requested)
        return 0
    return requested



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


