"""The DeepSpeed config of one engine (template + job settings), its LR schedule and weight-decay groups."""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from astrai.engine.buckets import size_buckets
from astrai.errors import AstraiError

logger = logging.getLogger("astrai.engine")

# Sections of a DeepSpeed config that must be JSON objects (DeepSpeed would fail on anything else with a TypeError).
OBJECT_SECTIONS = ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "activation_checkpointing")
# DeepSpeed's pydantic models, by the config key they parse (for error messages naming the key).
SECTION_OF_MODEL = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
}


class DeepSpeedConfigError(AstraiError, ValueError):
    """A DeepSpeed template or `deepspeed.overrides` that DeepSpeed would refuse; the message names the file or key."""


def read_template(path: Path) -> dict:
    """A DeepSpeed JSON template as a dict, or a DeepSpeedConfigError naming the file (and line)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        where = f"{path}:{error.lineno}"
        raise DeepSpeedConfigError(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DeepSpeedConfigError(f"{path}: cannot read: {error}") from None
    if not isinstance(config, dict):
        kind = type(config).__name__
        raise DeepSpeedConfigError(f"{path}: a DeepSpeed config must be a JSON object {{...}}, not a {kind}")
    _check_sections(config, str(path))
    return config


def _check_sections(config: dict, origin: str) -> None:
    for key in OBJECT_SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise DeepSpeedConfigError(f"{origin}: {key} must be an object {{...}}, got {config[key]!r}")


def check_ds_config(config: dict, origin: str) -> None:
    """Parse `config` as DeepSpeed will (its own pydantic models and sanity checks), on no rank and with no
    process group, so what DeepSpeed refuses (ZeRO stage 7, a string where a number goes) stops the job
    before any rank starts. `origin` (the template and/or `deepspeed.overrides`) heads the message."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    _check_sections(config, origin)
    candidate = copy.deepcopy(config)
    candidate.pop("train_batch_size", None)  # consistent with the world size only at run time; DeepSpeed derives it
    deepspeed_logger = logging.getLogger("DeepSpeed")
    level = deepspeed_logger.level
    deepspeed_logger.setLevel(logging.WARNING)  # it logs the world size it assumed at INFO
    try:
        DeepSpeedConfig(candidate)
    except ValidationError as error:
        item = error.errors()[0]
        key = ".".join([SECTION_OF_MODEL.get(error.title, error.title), *map(str, item["loc"])])
        raise DeepSpeedConfigError(f"{origin}: {key}: {error_message(item)} (got {item.get('input')!r})") from None
    except (TypeError, ValueError, AssertionError, KeyError, AttributeError) as error:
        raise DeepSpeedConfigError(f"{origin}: DeepSpeed refuses the config: {error}") from None
    finally:
        deepspeed_logger.setLevel(level)


def error_message(item: dict) -> str:
    """pydantic's message for one error, with an enum's allowed values listed once: DeepSpeed's ZeroStageEnum
    has an alias (`max_stage = 3`), which pydantic lists as "0, 1, 2, 3 or 3"."""
    expected = item.get("ctx", {}).get("expected")
    if item["type"] != "enum" or not isinstance(expected, str):
        return item["msg"]
    head, _, last = expected.rpartition(" or ")
    values = list(dict.fromkeys([*filter(None, head.split(", ")), last]))
    return "Input should be " + (f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0])


def effective_zero_stage(requested: int, world_size: int, offloaded: bool, keep: bool) -> int:
    """ZeRO-1/2 on a single rank partition over one process: all cost, no memory saved. Run
    stage 0 there unless offload needs ZeRO or the job keeps the stage (`deepspeed.single_rank_stage0: false`)."""
    if world_size == 1 and requested in (1, 2) and not offloaded and not keep:
        logger.info(
            "one rank: ZeRO-%d partitions nothing here, running ZeRO-0 (set deepspeed.single_rank_stage0: false to "
            "keep it)",
            requested,
        )
        return 0
    return requested


def deep_merge(base: dict, extra: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        merged[key] = (
            deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
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
    hidden_size: int | None = None,
) -> dict:
    """Template (if any) <- job settings <- `deepspeed.overrides`, then bucket sizes the user left out (or
    set to "auto") derived from the model's `hidden_size` (engine/buckets.py). The result is what DeepSpeed sees."""
    config: dict = read_template(template_path) if template_path else {}
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
        zero["stage"] = effective_zero_stage(
            zero["stage"], world_size, any_offload, keep=not section.single_rank_stage0
        )
    implementation = section.optimizer
    if implementation == "auto":
        implementation = "cpu_adam" if offloaded else ("fused" if torch.cuda.is_available() else "torch")
    params: dict[str, Any] = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": 0.0}
    if implementation == "torch":
        params["torch_adam"] = True  # DeepSpeed's FusedAdam is CUDA-only
        if not torch.cuda.is_available():
            # torch's own fused CPU AdamW: one pass over each flat partition, where the default loop allocates two
            # temporaries of its size (sqrt, then the division) on top of the moments, ~10x slower at 0.5B's size
            params["fused"] = True
    elif implementation == "cpu_adam" and not offloaded:
        raise DeepSpeedConfigError("deepspeed.optimizer: cpu_adam needs deepspeed.offload_optimizer: cpu")
    config["optimizer"] = {"type": "AdamW", "params": params}
    config = deep_merge(config, section.overrides)
    if isinstance(config.get("zero_optimization"), dict):  # anything else is refused by check_ds_config
        size_buckets(config["zero_optimization"], hidden_size)
    return config


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
