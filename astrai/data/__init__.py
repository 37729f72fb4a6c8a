"""Data: local files through `datasets`, chat rendering and loss masks, packing, sharded order, collation."""

from __future__ import annotations

from typing import Callable

import datasets

from astrai.data.render import RowError
from astrai.data.sources import DataError, Rows

__all__ = ["DataError", "tokenize_rows"]


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
