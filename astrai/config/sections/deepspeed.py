"""The `deepspeed` section: a template from `ds_configs/` plus the job's overrides."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from astrai.config.sections.base import Section


class DeepSpeedSection(Section):
    config: str | None = Field(
        None, description="Template JSON (e.g. `ds_configs/zero3.json`), relative to the repo or the job file."
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(None, description="ZeRO stage; overrides the template's.")
    offload_optimizer: Literal["none", "cpu", "nvme"] | None = Field(
        None, description="Optimizer state offload; overrides the template."
    )
    offload_param: Literal["none", "cpu", "nvme"] | None = Field(
        None, description="Parameter offload (ZeRO-3); overrides the template."
    )
    optimizer: Literal["auto", "torch", "fused", "cpu_adam"] = Field(
        "auto",
        description="AdamW implementation: `auto` = fused on CUDA, torch on CPU, DeepSpeedCPUAdam with optimizer "
        "offload.",
    )
    single_rank_stage0: bool = Field(
        True,
        description="On one rank, run ZeRO-1/2 (without offload) as ZeRO-0: they partition nothing there and only "
        "cost time.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Raw DeepSpeed config keys merged last (deep merge)."
    )
