"""The `dpo` section: preference optimisation (`train_type: dpo`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astrai.config.sections.base import Section


class DpoConfig(Section):
    beta: float = Field(
        0.1,
        gt=0,
        description="`sigmoid`/`ipo`/`hinge`: strength of the implicit KL to the reference (DPO's beta); `simpo`: "
        "scale of the average log-prob reward (SimPO's beta, paper: 2-2.5); `orpo`: weight of the odds-ratio term "
        "beside the NLL (ORPO's lambda, TRL's default 0.1).",
    )
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = Field(
        "sigmoid",
        description="`sigmoid`: DPO; `ipo`: IPO's squared loss; `hinge`: SLiC-style hinge; reference-free (no "
        "reference model is built): `simpo`: SimPO on average token log-probs with margin `dpo.simpo_gamma`; `orpo`: "
        "ORPO, NLL on chosen plus the odds-ratio term.",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed label-flip rate (conservative DPO); `sigmoid` only."
    )
    precompute_reference: bool = Field(
        False,
        description="Compute the reference log-probs of every pair once before training, then free the reference "
        "model.",
    )
    simpo_gamma: float = Field(
        0.5,
        ge=0,
        description="`simpo` only: target reward margin gamma, subtracted from beta x (avg chosen - avg rejected "
        "log-prob) (TRL's `simpo_gamma`; the SimPO paper's gamma/beta ratio is ~0.5, e.g. beta 2.5, gamma 1.25).",
    )
