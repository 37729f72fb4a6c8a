"""The `reward` section: the reward of the online train types, from one source or weighted components."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from astrai.config.sections.base import Section


class RewardComponent(Section):
    function: str | None = Field(
        None,
        description="A Python callable 'package.module:function' returning one float per response (arguments: "
        "docs/guides/reward-models.md).",
    )
    model_path: str | None = Field(
        None, description="Local AutoModelForSequenceClassification folder (one output) scoring prompt + response."
    )
    url: str | None = Field(
        None, description='HTTP service: POST JSON prompts/responses/rows, answer {"rewards": [...]}.'
    )
    name: str | None = Field(
        None,
        description="Name in errors and metrics (default: the function's name, the model folder's name or the URL).",
    )
    weight: float = Field(1.0, description="Multiplier of this reward in the weighted sum.")
    timeout_s: float = Field(
        30.0, gt=0, description="`url`: seconds one attempt may take in all: connect, send, and read the whole answer."
    )
    retries: int = Field(
        2, ge=0, description="`url`: further attempts after a failed one (connection error, timeout, HTTP 408/429/5xx)."
    )
    retry_backoff_s: float = Field(
        1.0, ge=0, description="`url`: wait before the first retry, doubled before each next one."
    )
    batch_size: int = Field(8, ge=1, description="`model_path`: responses per reward-model forward.")
    normalize: Literal["none", "stored"] = Field(
        "none",
        description="`model_path`: `stored` standardises the model's rewards, (r - mean) / std, with the mean and std "
        "over its training pairs that an rm export records (reward_stats.json).",
    )
    max_response_bytes: int = Field(
        16 * 2**20, ge=1, description="`url`: largest answer accepted, in bytes; a larger one is an error."
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardComponent:
        if sum(value is not None for value in (self.function, self.model_path, self.url)) != 1:
            raise ValueError("give exactly one of `function`, `model_path` or `url`")
        return self

    @model_validator(mode="after")
    def _stored_statistics(self) -> RewardComponent:
        if self.normalize == "stored" and self.model_path is None:
            raise ValueError("`normalize: stored` applies to a `model_path` reward only")
        return self

    @model_validator(mode="after")
    def _http_url(self) -> RewardComponent:
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"`url` {self.url!r} must be an http:// or https:// address with a host")
        return self


class RewardConfig(RewardComponent):
    """The reward of the online train types: one source, or `components` summed with their weights."""

    components: list[RewardComponent] | None = Field(
        None,
        description="Several rewards, each {function | model_path | url, weight, ...}; the reward is their weighted "
        "sum.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if sum(value is not None for value in (self.function, self.model_path, self.url, self.components)) != 1:
            raise ValueError(
                "give exactly one of `reward.function`, `reward.model_path`, `reward.url` or `reward.components`"
            )
        return self
