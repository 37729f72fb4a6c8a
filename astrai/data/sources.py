"""Local data files through `datasets`: json/jsonl, parquet, arrow; one file, a folder or a glob."""

from __future__ import annotations

import glob
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import datasets

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


class DataError(Exception):
    """Unreadable data or a malformed row; the message names the file and the row."""


def find_files(path: str) -> list[Path]:
    """Every data file `path` names, sorted, so the global order is the same on every rank."""
    candidate = Path(path)
    if candidate.is_dir():
        files = [p for p in candidate.rglob("*") if p.suffix in BUILDERS]
    else:
        files = [Path(p) for p in glob.glob(path)]
    files = sorted(f for f in files if f.is_file())
    if not files:
        raise DataError(f"data.path: no json/jsonl/parquet/arrow file found at {path!r}")
    return files


@dataclass
class Rows:
    """The raw rows of every file, concatenated, with enough bookkeeping to name a row's file."""

    dataset: datasets.Dataset
    files: list[Path]
    starts: list[int]  # global index of each file's first row

    def locate(self, index: int) -> str:
        position = bisect_right(self.starts, index) - 1
        return f"{self.files[position]} row {index - self.starts[position] + 1}"


def load_rows(path: str, file_format: str, cache_dir: Path) -> Rows:
    files = find_files(path)
    parts, starts, total = [], [], 0
    for file in files:
        builder = BUILDERS[file.suffix] if file_format == "auto" else file_format
        try:
            part = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=str(cache_dir))
        except Exception as error:  # datasets raises many types for a bad file; all mean "cannot read"
            raise DataError(f"{file}: cannot read as {builder}: {error}") from None
        parts.append(part)
        starts.append(total)
        total += len(part)
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return Rows(dataset, files, starts)


def iter_texts(rows: Rows, fields: tuple[str, ...]):
    """Every string under the given fields (messages flattened): what a built tokenizer learns from."""
    for row in rows.dataset:
        for field in fields:
            yield from _strings(row.get(field))


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
