"""The `rollout` section: sampling of the online train types."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astrai.config.sections.base import Section


class RolloutConfig(Section):
    prompts_per_step: int = Field(
        8,
        ge=1,
        description="Prompts per step across all ranks (a multiple of the number of ranks); each step samples "
        "prompts_per_step x group_size responses.",
    )
    group_size: int = Field(
        8, ge=1, description="Responses sampled per prompt; `grpo` scores each against the others of its group (>= 2)."
    )
    max_new_tokens: int = Field(
        64,
        ge=1,
        description="Longest response in tokens; a response that reaches it without EOS is cut there (metric "
        "`truncated_frac`).",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature; the loss's log-probs use the same temperature, so ratios compare like with "
        "like.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling (1: off). Below 1 the ratio ignores the truncation: a small bias.",
    )
    top_k: int = Field(
        0, ge=0, description="Sample among the k likeliest tokens only (0: off). Same caveat as `top_p`."
    )
    zero3_generation: Literal["copy", "gather"] = Field(
        "copy",
        description="ZeRO-3 only: `copy` samples from a plain copy of the policy allocated for each rollout (one full "
        "copy of the weights per rank while sampling; ~5x faster on a CPU); `gather` samples from the partitioned "
        "module inside one gather (same peak memory, DeepSpeed's hooks at every forward).",
    )
    behaviour_logprobs: Literal["auto", "recompute", "sampler"] = Field(
        "auto",
        description="Where the ratio's behaviour log-probs come from: `recompute`: one forward of the policy engine "
        "after sampling, the loss's own call, so the first ratio is exactly 1; `sampler`: kept from the sampling "
        "logits at each step (no extra forward: 1.1x the rollout tokens/s in benchmarks/rollout_speed.py; the "
        "KV-cached kernels differ from the full forward by ~1e-6 in fp32, ~1e-2 in bf16); `auto`: `sampler` when the "
        "policy trains in fp32, `recompute` in bf16/fp16.",
    )
    share_prefill: bool = Field(
        True,
        description="Prefill each prompt once and repeat its KV cache to the group before decoding, instead of "
        "prefilling all group_size copies (TRL's way); same tokens and log-probs for the same seed. false: every "
        "copy prefilled.",
    )
