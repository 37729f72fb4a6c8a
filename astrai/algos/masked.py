"""Masked reductions over right-padded token tensors, and the one place a loss is aggregated.

A mask is a 0/1 float tensor or a bool tensor of the same shape as the values (or one that
broadcasts to it); a nonzero entry marks a valid token. Padded positions may hold anything,
even NaN or inf: every function here selects with `torch.where` rather than multiplying by
the mask, so junk in padding reaches neither the result nor the gradient (0 * NaN is NaN).

Empty masks are not errors: a mean over no valid entries is 0, never NaN, and no function
here reads a value back to the host (no `.item()`, no data-dependent Python branch), so they
are safe inside a training step on an accelerator.

Departures from common practice: `masked_var` returns 0 where fewer than two entries are
valid with `unbiased=True` (TRL raises); `masked_whiten` writes 0 at padded positions.
"""

import math
from collections.abc import Callable

import torch

WHITEN_EPS = 1e-8
AGGREGATIONS = ("token_mean", "sequence_mean", "global", "global_sequence")


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool() if mask.dtype != torch.bool else mask


def _count_dtype(dtype: torch.dtype) -> torch.dtype:
    # Counts above 256 are not exact in bfloat16: count (and divide) in at least float32.
    return dtype if dtype == torch.float64 else torch.float32


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over valid entries: sum_i values_i * [mask_i != 0].

    values: any shape, e.g. [batch, seq_len]; mask: same shape (or broadcastable).
    dim: None sums everything (scalar); an int sums that dimension only.
    """
    selected = torch.where(_valid(mask), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of valid entries (as `dtype`), over everything or along `dim`."""
    valid = _valid(mask).to(dtype)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def rows_with_tokens(mask: torch.Tensor) -> torch.Tensor:
    """[batch] bool: which rows of a [batch, seq_len] mask have at least one valid token."""
    return _valid(mask).any(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over valid entries: sum(values * mask) / sum(mask); 0 where mask is empty.

    values, mask: same shape, e.g. [batch, seq_len]. dim: None (scalar) or the dimension to reduce.
    Half-precision values give a float32 mean (the count is not exact in bfloat16).
    """
    total = masked_sum(values, mask, dim)
    count = masked_count(torch.broadcast_to(_valid(mask), values.shape), dim, dtype=_count_dtype(total.dtype))
    # Divide by 1 where count is 0 (total is 0 there too): a 0/0 in an unselected
    # torch.where branch would still put NaN into the gradient.
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries (a scalar).

    var = sum(mask * (values - mean)^2) / n, times n / (n - 1) when `unbiased` (Bessel),
    with mean = masked_mean(values, mask) and n the number of valid entries.
    Returns 0 when n is 0, or when n is 1 and `unbiased` (the variance is undefined there).
    """
    mean = masked_mean(values, mask)
    biased = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return biased
    count = masked_count(torch.broadcast_to(_valid(mask), values.shape), dtype=_count_dtype(biased.dtype))
    correction = count / torch.where(count > 1, count - 1, torch.ones_like(count))
    return torch.where(count > 1, biased * correction, torch.zeros_like(biased))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten valid entries with their own statistics: (values - mean) / sqrt(var + 1e-8).

    mean and (unbiased) var are taken over valid entries only. With `shift_mean=False` the mean
    is added back: values are only rescaled (used for advantages that must keep their sign).
    Shape: same as `values`; padded positions are 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(_valid(mask), whitened, torch.zeros_like(whitened))


def global_standardize(
    values: torch.Tensor,
    mask: torch.Tensor,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the mean and unbiased variance of the valid entries of
    every rank; 0 at padding. values, mask: any one shape ([N, R] tokens or [N] responses).

    sum_over_ranks: adds a list of Python numbers over every rank (one all-reduce, the caller's; this
    module stays free of communication); None is this process alone, which is `masked_whiten`."""
    valid = mask.bool()
    selected = values[valid].double()
    moments = [float(valid.sum()), float(selected.sum()), float((selected**2).sum())]
    count, total, squares = sum_over_ranks(moments) if sum_over_ranks is not None else moments
    mean = total / max(count, 1.0)
    variance = max(squares - count * mean**2, 0.0) / max(count - 1.0, 1.0)
    standardized = (values - mean) / math.sqrt(variance + WHITEN_EPS)
    return torch.where(valid, standardized, torch.zeros_like(standardized))


def masked_aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token_mean",
    global_token_count: torch.Tensor | float | int | None = None,
    *,
    global_sequence_count: torch.Tensor | float | int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `values` [batch, seq_len] to a scalar.

    aggregation:
      "token_mean":      sum_{b,t} mask*values / sum_{b,t} mask  (every valid token of this batch weighs the same)
      "sequence_mean":   mean over sequences with >= 1 valid token of (sum_t mask*values / sum_t mask)
                         (every sequence weighs the same, whatever its length)
      "global":          sum_{b,t} mask*values / global_token_count
      "global_sequence": sum over sequences with >= 1 valid token of (sum_t mask*values / sum_t mask)
                         / global_sequence_count (verl's seq-mean-token-mean with a global batch size)
    `global_token_count` is the number of valid tokens across ALL ranks and micro-batches of one
    optimizer step (a number or an all-reduced tensor); `global_sequence_count` the number of
    sequences with >= 1 valid token across them (`rows_with_tokens`): a row without tokens has no
    mean and counts nowhere. Dividing every micro-batch's sum by that one number makes the gradients
    summed over micro-batches and ranks equal the gradient of the "token_mean" ("sequence_mean")
    loss of the whole step's batch, whatever the split. The caller must undo any averaging its
    engine does (DeepSpeed divides by gradient_accumulation_steps and averages over the
    data-parallel ranks: multiply the loss by both to get a plain sum).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    counts = {
        "global": ("global_token_count", global_token_count),
        "global_sequence": ("global_sequence_count", global_sequence_count),
    }
    for mode, (name, given) in counts.items():
        if mode != aggregation:
            if given is not None:
                raise ValueError(f"{name} is only used with aggregation {mode!r}, not {aggregation!r}")
        elif given is None:
            raise ValueError(f"aggregation {mode!r} needs {name} (valid units in the whole step)")
        elif not isinstance(given, torch.Tensor) and given <= 0:
            raise ValueError(f"{name} must be > 0, got {given}")
    count = counts.get(aggregation, (None, None))[1]
    if aggregation == "global":
        return masked_sum(values, mask) / count
    if aggregation == "token_mean":
        return masked_mean(values, mask)
    per_sequence = masked_mean(values, mask, dim=-1)  # 0 for a row without tokens
    has_tokens = rows_with_tokens(torch.broadcast_to(_valid(mask), values.shape))
    if aggregation == "global_sequence":
        return masked_sum(per_sequence, has_tokens) / count
    return masked_mean(per_sequence, has_tokens)
