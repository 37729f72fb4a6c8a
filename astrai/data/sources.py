"""Local data files through `datasets`: json/jsonl, parquet, arrow; one file, a folder or a glob."""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import datasets

from astrai.errors import AstraiError

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
SCAN_CHUNK_BYTES = 1 << 24

logger = logging.getLogger("astrai.data")


class DataError(AstraiError):
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


def is_empty(file: Path) -> bool:
    """Whether `file` holds no rows: no bytes, or (JSON) only whitespace. datasets says nothing useful of
    one ("cannot read as json: " with an empty reason)."""
    size = file.stat().st_size
    return size == 0 or (file.suffix in (".json", ".jsonl") and size <= 1 << 16 and not file.read_bytes().strip())


def empty_files(path: str) -> list[Path]:
    """The data files `path` names that hold no rows."""
    return [file for file in find_files(path) if is_empty(file)]


@dataclass
class Rows:
    """The raw rows of every file, concatenated, with enough bookkeeping to name a row's file."""

    dataset: datasets.Dataset
    files: list[Path]
    starts: list[int]  # global index of each file's first row

    def locate(self, index: int) -> str:
        position = bisect_right(self.starts, index) - 1
        return f"{self.files[position]} row {index - self.starts[position] + 1}"


def load_rows(path: str, file_format: str, cache_dir: Path, skip_bad: bool = False) -> Rows:
    """Every file's rows. JSON files must be UTF-8 (pyarrow reads other bytes without complaint and
    fails later, deep in tokenisation): a row that is not stops the load naming file and row, or with
    `skip_bad` (data.on_bad_row: skip) is left out, the file read from a copy without it, and counted."""
    files = find_files(path)
    parts, starts, total = [], [], 0
    for file in files:
        builder = BUILDERS[file.suffix] if file_format == "auto" else file_format
        if is_empty(file):
            raise DataError(f"{file}: the file is empty: no rows to read")
        source = file
        if builder == "json":
            source = utf8_rows_of(file, cache_dir, skip_bad)
        try:
            part = datasets.load_dataset(builder, data_files=str(source), split="train", cache_dir=str(cache_dir))
        except Exception as error:  # datasets raises many types for a bad file; all mean "cannot read"
            raise DataError(f"{file}: cannot read as {builder}: {error}") from None
        refuse_changed_values(source, part)
        parts.append(part)
        starts.append(total)
        total += len(part)
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return Rows(dataset, files, starts)


def invalid_utf8_lines(file: Path) -> list[tuple[int, int, str]]:
    """(line number, row number, reason) of each line of `file` that is not UTF-8; rows count non-blank
    lines, as JSON Lines readers do. A fast whole-file pass first: clean files are never split into lines."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(file, "rb") as handle:
            while chunk := handle.read(SCAN_CHUNK_BYTES):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        return []
    except UnicodeDecodeError:
        pass
    bad, row = [], 0
    with open(file, "rb") as handle:
        for number, line in enumerate(handle, 1):
            row += bool(line.strip())
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                bad.append((number, row, f"byte 0x{line[error.start]:02x} at column {error.start + 1}: {error.reason}"))
    return bad


def utf8_rows_of(file: Path, cache_dir: Path, skip_bad: bool) -> Path:
    """`file` itself when every line is UTF-8; else a DataError naming the first bad row or, with
    `skip_bad`, a copy of the file without the bad lines (written once per file version, atomically)."""
    bad = invalid_utf8_lines(file)
    if not bad:
        return file
    number, row, reason = bad[0]
    if not skip_bad or file.suffix != ".jsonl":  # one JSON document cannot lose a line and stay JSON
        more = f" ({len(bad)} lines in all)" if len(bad) > 1 else ""
        hint = "; fix the file's encoding" + (" or set data.on_bad_row: skip" if file.suffix == ".jsonl" else "")
        raise DataError(f"{file}: row {row} (line {number}) is not valid UTF-8: {reason}{more}{hint}")
    status = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{status.st_size}:{status.st_mtime_ns}".encode()).hexdigest()[:16]
    copy = cache_dir / "utf8" / f"{file.stem}-{key}.jsonl"
    if not copy.is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        skipped_lines = {line for line, _, _ in bad}
        temporary = copy.with_name(f".{copy.name}.{os.getpid()}.tmp")
        with open(file, "rb") as source, open(temporary, "wb") as target:
            target.writelines(line for number, line in enumerate(source, 1) if number not in skipped_lines)
        os.replace(temporary, copy)
    logger.warning(
        "%s: skipped %d rows that are not valid UTF-8 (data.on_bad_row: skip), the first row %d (line %d): %s",
        file,
        len(bad),
        row,
        number,
        reason,
    )
    return copy


def mixed_type_columns(features, prefix: str = "") -> list[str]:
    """Columns (dotted; `[]` for list items) that datasets could only type as `Json`: their values have
    several types (a string in one row, a number in another)."""
    if isinstance(features, datasets.Json):
        return [prefix]
    if isinstance(features, dict):
        return [
            name
            for key, feature in features.items()
            for name in mixed_type_columns(feature, f"{prefix}.{key}" if prefix else key)
        ]
    inner = getattr(features, "feature", None)  # List, LargeList, Sequence
    return mixed_type_columns(inner, f"{prefix}[]") if inner is not None else []


def refuse_changed_values(file: Path, dataset: datasets.Dataset) -> None:
    """A JSON column whose values have several types (a string in one row, a number or a list in
    another) is one `datasets` can only keep as JSON text, decoded on read: a string that reads as
    JSON then comes back as another type ("2" -> 2, "true" -> True), and a reward comparing answers or
    a chat template sees silently changed data. Such columns are checked against the file, row by row;
    the first changed value is refused, naming its row. Values merely of another type (a malformed
    row, e.g. `messages` that is a string) come back unchanged and are left to data.on_bad_row."""
    mixed = sorted({name.split(".")[0].split("[")[0] for name in mixed_type_columns(dataset.features)})
    if not mixed or file.suffix not in (".jsonl", ".json"):
        return
    # Only the mixed columns are decoded again, row by row beside the file's own rows.
    for index, (original, decoded) in enumerate(zip(_json_rows(file), dataset.select_columns(mixed))):
        if not isinstance(original, dict):
            continue
        for column in mixed:
            if not _same_json(original.get(column), decoded[column]):
                raise DataError(
                    f"{file}: row {index + 1}, column {column!r}: datasets read {original.get(column)!r} as "
                    f"{decoded[column]!r}: the column has values of different types, which datasets keeps "
                    "as JSON and decodes on read. Give the column one type (e.g. quote every value as a string)"
                )


def _json_rows(file: Path):
    """The rows of a JSON Lines file (blank lines skipped, as datasets does) or of a JSON array document."""
    with open(file, encoding="utf-8") as handle:
        if file.suffix == ".json":
            document = json.load(handle)
            yield from document if isinstance(document, list) else ()
            return
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _same_json(original, decoded) -> bool:
    """Equal as JSON values, types included (2 is not "2", True is not 1); a key datasets filled with
    None (absent in this row, present in another) counts as absent."""
    if isinstance(original, dict) and isinstance(decoded, dict):
        keys = set(original) | {key for key, value in decoded.items() if value is not None}
        return all(_same_json(original.get(key), decoded.get(key)) for key in keys)
    if isinstance(original, list) and isinstance(decoded, list):
        return len(original) == len(decoded) and all(_same_json(a, b) for a, b in zip(original, decoded))
    if _is_number(original) and _is_number(decoded):  # 1 and 1.0 are one JSON number
        return original == decoded
    return type(original) is type(decoded) and original == decoded


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
