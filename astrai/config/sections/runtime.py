"""The `runtime` section: per-job process settings (environment, timeouts, logging, trackers)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from astrai.config.sections.base import Section

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENVIRONMENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # what a shell (and every launcher's env file) accepts


class RuntimeConfig(Section):
    environment: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables exported to every rank of this job (values rendered with str(); null = empty), e.g. "
        "`{ASTR_LOG_LEVEL: DEBUG, ASTR_BACKEND: sdpa}` (the trainer's log level; the attention implementation handed "
        "to transformers: sdpa, eager, flash_attention_2). Nothing comes from the host shell unless listed here.",
    )
    dist_timeout_s: float = Field(1800.0, gt=0, description="Timeout of every collective of the job's process groups.")
    log_level: str = Field(
        "INFO", description="Trainer log level (env ASTR_LOG_LEVEL overrides): DEBUG, INFO, WARNING, ERROR or CRITICAL."
    )
    progress_bar: bool = Field(True, description="tqdm bar on rank 0.")
    tensorboard: bool = Field(
        True,
        description="Older key, kept: with `runtime.trackers` unset, true writes TensorBoard events when `tensorboard` "
        "is installed (as before), false writes none. Prefer `runtime.trackers`.",
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="Experiment trackers fed every metrics record beside metrics.jsonl (always written), on rank 0: "
        "`tensorboard` (<output_dir>/tensorboard), `wandb` (offline under <output_dir>/wandb unless WANDB_MODE or "
        "WANDB_API_KEY says otherwise), `mlflow` (a file store <output_dir>/mlruns by default). Each is an extra "
        "(`pip install 'astrai[wandb]'`); one not installed fails before any rank starts. A resume continues the "
        "same tracker runs (<output_dir>/trackers.json). null: `runtime.tensorboard` decides "
        "(docs/guides/training.md).",
    )
    wandb_project: str = Field("astrai", description="W&B project of the run (entity: WANDB_ENTITY or your default).")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server `http://...`, `sqlite:///...`, `file:...`); null: a file store at "
        "<output_dir>/mlruns.",
    )
    mlflow_experiment: str = Field("astrai", description="MLflow experiment the run is created in (created if new).")
    tune_malloc: bool | Literal["auto"] = Field(
        "auto",
        description="Set glibc malloc's mmap/trim thresholds on every rank so each step's buffers are kept rather "
        "than faulted in again (1.1x tokens/s on a CPU for small models; skipped where another allocator is preloaded "
        "or MALLOC_*_ is set; astrai/engine/host_memory.py). `auto`: for a policy under 100M parameters; above, "
        "freed blocks over 128 KiB go back to the kernel instead (at Qwen2.5-0.5B's size the kept heap, and glibc's "
        "own defaults, cost 2.4-2.7 GiB per rank: docs/benchmarks.md, 3c). true/false: always/never tuned.",
    )

    @field_validator("tune_malloc", mode="before")
    @classmethod
    def _tune_malloc_choice(cls, value: Any) -> bool | str:
        # One line for a wrong value, instead of pydantic's one per member of the union.
        if value == "auto" or isinstance(value, bool):
            return value
        try:
            return TypeAdapter(bool).validate_python(value)  # pydantic's own spellings: "yes", "off", 1, ...
        except ValidationError:
            raise ValueError(f"expected true, false or auto, not {value!r}") from None

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        return known_log_level(value)

    @field_validator("trackers")
    @classmethod
    def _distinct_trackers(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice: {value}")
        return value

    @field_validator("wandb_project")
    @classmethod
    def _wandb_project_name(cls, value: str) -> str:
        refused = [character for character in "/\\#?%:" if character in value]
        if refused or not value or len(value) > 128:
            raise ValueError(f"{value!r} is not a W&B project name (1-128 characters, none of / \\ # ? % :)")
        return value

    @model_validator(mode="after")
    def _one_tensorboard_answer(self) -> RuntimeConfig:
        """`runtime.tensorboard` given beside `runtime.trackers` must agree with it (else which one wins?)."""
        if self.trackers is not None and "tensorboard" in self.model_fields_set:
            if self.tensorboard != ("tensorboard" in self.trackers):
                raise ValueError(
                    f"`runtime.tensorboard: {str(self.tensorboard).lower()}` contradicts `runtime.trackers: "
                    f"{self.trackers}`; keep `runtime.trackers` alone"
                )
        return self

    @field_validator("environment")
    @classmethod
    def _variable_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [str(name) for name in value if not ENVIRONMENT_NAME.match(str(name))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a variable name (letters, digits and _, not starting with a digit)")
        return value


def known_log_level(value: str) -> str:
    """`value` if it names a log level (any case), else a ValueError listing the levels."""
    if str(value).upper() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {value!r}: one of {', '.join(LOG_LEVELS)}")
    return value
