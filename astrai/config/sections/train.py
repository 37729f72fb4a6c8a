"""The `train` section: the train type and its optimisation hyperparameters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from astrai.config.sections.base import Section


class TrainConfig(Section):
    train_type: Literal["seq", "sft", "dpo", "grpo", "online_ppo", "rm"] = Field(
        ..., description="What to train: see the table of train types."
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to run (exclusive with `epochs`).")
    epochs: float | None = Field(None, gt=0, description="Passes over the data; converted to steps from the data size.")
    micro_batch_size: int = Field(1, ge=1, description="Samples per rank per forward/backward.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    micro_batch_tokens: int = Field(
        4096,
        ge=8,
        description="With `data.packing`: the token budget of one packed micro-batch (replaces micro_batch_size); "
        "every row must fit in it (a dpo pair: chosen + rejected). With `rl.packing`: each optimizer step's "
        "sequences (micro_batch_size x grad_accum_steps per rank) are cut into micro-batches of up to this many "
        "prompt + response tokens, every sequence whole, as many on every rank; data.max_seq_len + "
        "rollout.max_new_tokens must fit in it.",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of `lr`.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int | None = Field(
        None,
        ge=0,
        description="Linear warmup steps (exclusive with `warmup_ratio`). Online types count steps in rollouts, as "
        "`max_steps`. A warmup longer than the run is warned about, once: the learning rate never reaches `lr`.",
    )
    warmup_ratio: float | None = Field(None, ge=0, le=1, description="Warmup as a fraction of the total steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (not applied to biases and norms).")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this (null: no clipping)."
    )
    seed: int = Field(
        42,
        description="Seeds Python, numpy and torch on every rank before anything is built (model init, dropout, "
        "sampling), and the data order: a rerun of the job repeats its losses exactly.",
    )
    log_every_steps: int = Field(1, ge=1, description="Write a metrics record every N optimizer steps.")
    logits_chunk_size: int = Field(
        512,
        ge=0,
        description="Token log-probs, entropy and the cross-entropy are computed from the final hidden states this "
        "many positions at a time, so the full [batch, seq_len, vocab] logits never exist (their backward recomputes "
        "each chunk's logits: one more output-layer matmul). Used when a micro-batch has more positions than one "
        "chunk; 0 = off. Models that change their logits after the output layer (Gemma 2 softcapping) take the full "
        "path (docs/guides/memory.md).",
    )
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop",
        description="A non-finite loss or gradient norm on any rank (decided on all ranks together): `stop` "
        "ends the run with exit 1 before the step's update and before any checkpoint of it (the last good checkpoint "
        "stays newest); `skip_step` "
        "discards that optimizer step's gradients, applies no update and counts it in the metric `skipped_steps`.",
    )

    @model_validator(mode="after")
    def _length(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of `train.max_steps` or `train.epochs`")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("give at most one of `train.warmup_steps` or `train.warmup_ratio`")
        return self
