"""The `export` section: Hugging Face export of the final policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astrai.config.sections.base import Section


class ExportConfig(Section):
    hf_dir: str | None = Field(
        None,
        description="Folder for a Hugging Face export of the final policy (null: `<output_dir>/hf`, so a run moved by "
        "`--set output_dir=...` never overwrites another run's export).",
    )
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of the exported weights.")
    on_finish: bool = Field(False, description="Export when the run ends.")
