"""Each engine's DeepSpeed config, derived from the job in one place: the builder, the job checks and the
memory planner all ask `engine_config(job, source, part=..., world_size=...)`.

The policy's engine takes `train.lr`, `train.max_grad_norm` and the DeepSpeed config's ZeRO stage;
online_ppo's critic its own `critic.lr`, `critic.max_grad_norm` and `critic.zero_stage`, each falling back
to the policy's when unset. Here rather than in the builder so that the launcher's checks and the planner,
which must not import the builder (it builds models), derive exactly what a run will use.
"""

from __future__ import annotations

from astrai.config import JobConfig, resolve_template
from astrai.engine import build_ds_config, resolve_precision
from astrai.models.shape import model_hidden_size

ENGINE_PARTS = ("policy", "critic")  # the engines a job may train; a strategy's `engine_parts` names its own


def part_optimizer(job: JobConfig, part: str) -> tuple[float, float | None, int | None]:
    """(lr, max_grad_norm, zero_stage) of the engine `part`; zero_stage None: the DeepSpeed config's."""
    if part not in ENGINE_PARTS:
        raise ValueError(f"unknown engine part {part!r} (one of {', '.join(ENGINE_PARTS)})")
    train = job.train
    if part == "critic":
        critic = job.critic
        return critic.lr or train.lr, critic.max_grad_norm or train.max_grad_norm, critic.zero_stage
    return train.lr, train.max_grad_norm, None


def engine_config(job: JobConfig, source: str, *, world_size: int, part: str = "policy") -> dict:
    """The DeepSpeed config of the engine `part` (`source`: the job file, for the template's relative path)."""
    lr, max_grad_norm, zero_stage = part_optimizer(job, part)
    template = resolve_template(job.deepspeed.config, source) if job.deepspeed.config else None
    return build_ds_config(
        job.deepspeed,
        template_path=template,
        micro_batch_size=job.train.micro_batch_size,
        grad_accum_steps=job.train.grad_accum_steps,
        max_grad_norm=max_grad_norm,
        precision=resolve_precision(job.model.dtype),
        lr=lr,
        betas=job.train.adam_betas,
        eps=job.train.adam_eps,
        zero_stage=zero_stage,
        world_size=world_size,
        hidden_size=model_hidden_size(job.model),  # ZeRO buckets sized to the model (engine/buckets.py)
    )
