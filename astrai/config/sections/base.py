"""The base of every section: unknown keys, non-finite numbers and bad defaults are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # No key of a job means anything with .inf or .nan: a non-finite lr or timeout is a typo, refused here.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)
