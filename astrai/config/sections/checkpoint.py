"""The `checkpoint` section: cadence, retention (newest and best), resume, verification."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from astrai.config.sections.base import Section


class KeepBest(Section):
    """The checkpoint to keep beside the newest `keep_last`: the best one by an eval metric."""

    metric: str = Field(
        ...,
        description="An eval metric the job's eval produces, e.g. `eval/loss` (the `eval/` prefix may be left out); "
        "checked before training.",
    )
    mode: Literal["min", "max"] = Field(..., description="`min`: lower is better (a loss); `max`: higher (accuracy).")

    @field_validator("metric")
    @classmethod
    def _prefixed(cls, value: str) -> str:
        return value if value.startswith("eval/") else f"eval/{value}"


class CheckpointConfig(Section):
    every_steps: int | None = Field(
        None, ge=1, description="Publish a checkpoint every N optimizer steps (always at the end of a run)."
    )
    keep_last: int | None = Field(
        None,
        ge=1,
        description="Keep the newest K checkpoints; older ones are removed only after a newer one is published.",
    )
    resume: str = Field(
        "auto", description="`auto`: newest valid checkpoint in output_dir; `never`: start fresh; or a checkpoint path."
    )
    verify_on_load: bool = Field(
        True,
        description="Check every file a resume loads against the manifest's digest (shards hashed as they load, "
        "the rest before); a mismatch falls back to the previous checkpoint. `false`: sizes only.",
    )
    keep_best: KeepBest | None = Field(
        None,
        description="Keep the best checkpoint by an eval metric beside the newest `keep_last` (retention never deletes "
        "it); each checkpoint's manifest records the eval figures of its step; `export-hf --best` exports it.",
    )
    hash: Literal["sha256", "blake2b", "xxh3_128"] = Field(
        "sha256",
        description="File digest recorded in the manifest: sha256 (~1.1 GB/s a core, cryptographic; files hash in "
        "parallel threads and across ranks), or xxh3_128 (~10 GB/s a core) where hashing would show in save time.",
    )
    save_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A save that cannot finish on every rank within this fails with the stalled phase named.",
    )
    async_save: bool = Field(
        False,
        description="Training goes on while a save is hashed, fsynced and published in a background thread (it blocks "
        "only while the shards are written); the next save, and the run's end, wait for it and fail on its error. The "
        "final save is always synchronous.",
    )
