"""ZeRO bucket sizes derived from the model's hidden size, unless the job sets them.

DeepSpeed's defaults are sized for large GPUs, whatever the model: a 5e8-element reduce bucket (2 GB of
fp32 per rank), a 5e8-element all-gather bucket for ZeRO-1/2, and up to 1e9 gathered parameters live
under ZeRO-3. On a 0.5B model that is more than a rank's share of the model states (issue #29: ZeRO-3 on
2 ranks was killed by the OOM killer with the defaults, and ran once sized to the model). transformers'
DeepSpeed integration fills its `auto` values from the hidden size h (integrations/deepspeed.py):

    reduce_bucket_size                  h^2        (ZeRO-1/2/3)
    stage3_prefetch_bucket_size         0.9 h^2    (ZeRO-3)
    stage3_param_persistence_threshold  10 h       (ZeRO-3: smaller parameters are kept whole)

We add, as measured in issue #29: allgather_bucket_size h^2 (ZeRO-1/2), and stage3_max_live_parameters
and stage3_max_reuse_distance 1e8 (ZeRO-3). A key the template or `deepspeed.overrides` sets to a
number wins; a key left out or set to "auto" is derived. Without a known hidden size, "auto" keys fall
back to DeepSpeed's own defaults (a string would fail its config parser).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("astrai.engine")

ZERO3_LIVE_PARAMETERS = 100_000_000
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), used for "auto" when the hidden size is unknown.
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def derived_bucket_sizes(hidden_size: int, stage: int | None = None) -> dict[str, int]:
    """The zero_optimization keys that matter at `stage` (every bucket key for None), sized for a model of
    `hidden_size`."""
    square = hidden_size * hidden_size
    zero12 = {"reduce_bucket_size": square, "allgather_bucket_size": square}
    zero3 = {
        "reduce_bucket_size": square,
        "stage3_prefetch_bucket_size": int(0.9 * square),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": ZERO3_LIVE_PARAMETERS,
        "stage3_max_reuse_distance": ZERO3_LIVE_PARAMETERS,
    }
    if stage is None:
        return {**zero12, **zero3}
    return zero12 if stage in (1, 2) else zero3 if stage == 3 else {}


def size_buckets(zero: dict, hidden_size: int | None) -> dict:
    """`zero` (a resolved `zero_optimization` section, changed in place and returned) with every bucket key
    of its stage that is missing or "auto" derived from `hidden_size`, and any other "auto" bucket key too
    (a template's stage-3 keys on a stage-0 run). Without a hidden size, "auto" keys get DeepSpeed's
    defaults. Numbers the user wrote are kept."""
    try:
        stage = int(zero.get("stage", 0))
    except (TypeError, ValueError):  # not a stage ("bogus", a list): check_ds_config refuses it, naming the key
        stage = -1  # no stage's buckets
    if hidden_size:
        for key, value in derived_bucket_sizes(hidden_size, stage).items():
            zero.setdefault(key, value)
        every = derived_bucket_sizes(hidden_size)
    else:
        every = {}
    for key, value in list(zero.items()):
        if value == "auto" and key in DEEPSPEED_DEFAULTS:
            zero[key] = every.get(key, DEEPSPEED_DEFAULTS[key])
            if key not in every:
                logger.info("zero_optimization.%s: auto without a known hidden size: DeepSpeed's default", key)
    return zero
