"""Rows of `rm` (reward-model) training: dpo's preference pairs plus each pair's margin."""

from __future__ import annotations

import math

from astrai.data.render import RowError, preference_batch


def reward_pair_batch(batch: dict[str, list], indices: list[int], *, margin_field: str | None, **options):
    """`datasets.map` function: dpo's `preference_batch`, plus each pair's `margin` (0.0 without a
    margin field). A row whose margin is missing or not a finite number is bad like any malformed row."""
    out = preference_batch(batch, indices, **options)
    margins = []
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    for row, index, bad in zip(rows, indices, out["bad"]):
        value = 0.0 if margin_field is None else row.get(margin_field)
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not valid and not bad:
            if not options["skip_bad"]:
                raise RowError(index, f"rm.margin_field {margin_field!r} must be a finite number, got {value!r}")
            out["bad"][len(margins)] = True
        margins.append(float(value) if valid else 0.0)
    out["margin"] = margins
    return out
