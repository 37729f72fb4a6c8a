"""The `eval` section: held-out evaluation during training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from astrai.config.sections.base import Section


class EvalConfig(Section):
    """Held-out evaluation during training (docs/guides/training.md, "Evaluation")."""

    data_path: str | None = Field(
        None, description="Eval data, in the formats of `data.path` (exclusive with `holdout`)."
    )
    format: Literal["auto", "json", "parquet", "arrow"] = Field(
        "auto", description="File format of `data_path`; `auto` reads it from the extension."
    )
    holdout: float | int | None = Field(
        None,
        gt=0,
        description="Hold out of `data.path` a fraction (0 < x < 1) or a count (an integer >= 1) of the prepared "
        "examples, chosen by `train.seed`, the same on every rank and on resume; never trained on.",
    )
    every_steps: int | None = Field(
        None, ge=1, description="Evaluate every N steps (null: only at the end; there is always one at the end)."
    )
    max_samples: int | None = Field(
        None, ge=1, description="Evaluate at most this many examples (prompts for the online types): the first ones."
    )
    at_start: bool = Field(False, description="Also evaluate before the first step of a fresh run (logged as step 0).")
    pass_k: int = Field(
        1,
        ge=1,
        description="Online types: k of `eval/pass@k`, the unbiased estimate from `samples_per_prompt` answers.",
    )
    samples_per_prompt: int | None = Field(
        None,
        ge=1,
        description="Online types: answers sampled per eval prompt with the training sampler (null: "
        "`rollout.group_size`); at least `pass_k`.",
    )
    pass_threshold: float = Field(
        1.0,
        description="Online types: an answer passes (pass@k, `greedy_pass`) when its total reward is at least this.",
    )
    log_samples: int = Field(
        4, ge=0, description="Online types: prompts (with their answers) appended to `eval_samples.jsonl` per eval."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if (self.data_path is None) == (self.holdout is None):
            raise ValueError("an eval section needs data: give exactly one of `eval.data_path` or `eval.holdout`")
        if isinstance(self.holdout, float) and not self.holdout < 1:
            raise ValueError(f"`eval.holdout` {self.holdout} is neither a fraction (< 1) nor a count (an integer)")
        if self.samples_per_prompt is not None and self.samples_per_prompt < self.pass_k:
            raise ValueError(
                f"`eval.pass_k` {self.pass_k} > `eval.samples_per_prompt` {self.samples_per_prompt}: pass@k needs "
                "at least k answers per prompt"
            )
        return self
