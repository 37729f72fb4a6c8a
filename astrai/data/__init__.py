"""Data: local files through `datasets`, chat rendering and loss masks, packing, sharded order, collation."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import datasets

from astrai.data.render import RowError
from astrai.data.sources import DataError, Rows

__all__ = ["DataError", "render_rows", "tokenize_rows"]


def tokenize_rows(rows: Rows, function: Callable, *, num_proc: int, description: str) -> datasets.Dataset:
    """Run a batched `map(function, with_indices=True)` over the rows; a RowError names file and row.

    Results are cached beside the loaded files (under the output dir; datasets fingerprints the function).
    """
    try:
        return rows.dataset.map(
            function,
            batched=True,
            with_indices=True,
            remove_columns=rows.dataset.column_names,
            num_proc=num_proc if num_proc > 1 else None,
            desc=description,
            cache_file_name=None,
        )
    except RowError as error:
        raise DataError(f"{rows.locate(error.index)}: {error}") from None
    except Exception as error:  # datasets wraps worker errors; find ours inside
        cause = error.__cause__ or error.__context__
        if isinstance(cause, RowError):
            raise DataError(f"{rows.locate(cause.index)}: {cause}") from None
        raise


def render_rows(
    rows: Rows, batch_function: Callable, *, tokenizer, data, description: str
) -> tuple[datasets.Dataset, int]:
    """Render rows with a `*_batch` function of `astrai.data.render` / `astrai.rollout.prompts`, which flags
    the rows it cannot use in a `bad` column; drop those. Returns (dataset, rows skipped). `data` is the
    job's `data:` section: with `on_bad_row: skip` bad rows are counted, otherwise the first one stops
    the job with its file and row named."""
    function = partial(
        batch_function, tokenizer=tokenizer, fields=data, max_len=data.max_seq_len, skip_bad=data.on_bad_row == "skip"
    )
    dataset = tokenize_rows(rows, function, num_proc=data.num_proc, description=description)
    skipped = sum(dataset["bad"])
    return dataset.filter(lambda row: not row["bad"]).remove_columns("bad"), skipped
