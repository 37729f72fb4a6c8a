"""Digests checked while a checkpoint's files are read for loading, not in a pass of their own.

A resume reads every byte of the shards it loads anyway. Within `checking_reads(check)`, a reader that
loads a file through `read_checked(path, read)` (the engine's weights-only `torch.load`) has that
file hashed in a thread beside the read (a second read of the same bytes, from the page cache; hashlib
and xxhash release the GIL) and compared with the manifest once the read returns: a file whose bytes
changed after it was published (a flipped bit keeps the size) raises CheckpointVerifyError "wrong
digest" before the caller sees what was read. Files no reader asks for are not hashed here: the
caller checks those beforehand (`verify_checkpoint(..., hash_later=...)`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TypeVar

from .errors import CheckpointVerifyError
from .hashing import FileDigest, hash_file, new_hasher
from .manifest import Manifest

Value = TypeVar("Value")


class ReadCheck:
    """The manifest's size and digest of each of `paths` (relative to `checkpoint_dir`), looked up by the
    absolute path a reader opens; counts what matched (`files`, `bytes`). A file that matched is not
    hashed again when read again (DeepSpeed reads a ZeRO-0 model-states file twice)."""

    def __init__(self, checkpoint_dir: Path, manifest: Manifest, paths: Iterable[str]):
        new_hasher(manifest.hash_algorithm)  # an unknown or unavailable algorithm fails here, not mid-load
        self.checkpoint = Path(checkpoint_dir)
        self.algorithm = manifest.hash_algorithm
        self._expected = {
            os.path.realpath(self.checkpoint / relative): (relative, manifest.files[relative]) for relative in paths
        }
        self.files = 0
        self.bytes = 0
        self._matched: set[str] = set()
        self._lock = threading.Lock()

    def expected(self, path) -> tuple[str, FileDigest] | None:
        """(relative path, manifest entry) of `path` when it is one of the files still to check, else None."""
        found = self._expected.get(os.path.realpath(path))
        return None if found is None or found[0] in self._matched else found

    def compare(self, relative: str, expected: FileDigest, actual: FileDigest) -> None:
        """Raise CheckpointVerifyError when `actual` (what was read) differs from the manifest's entry."""
        if actual.size != expected.size:
            detail = f"{actual.size} bytes read, {expected.size} in the manifest"
            raise CheckpointVerifyError(self.checkpoint, "wrong size", detail, relative)
        if actual.digest != expected.digest:
            detail = f"{self.algorithm} {actual.digest} as loaded, manifest says {expected.digest}"
            raise CheckpointVerifyError(self.checkpoint, "wrong digest", detail, relative)
        with self._lock:
            self._matched.add(relative)
            self.files += 1
            self.bytes += actual.size


_ACTIVE: ContextVar[ReadCheck | None] = ContextVar("astrai_checkpoint_read_check", default=None)


@contextmanager
def checking_reads(check: ReadCheck | None):
    """Within the block, `read_checked` compares the files of `check` (None: checks nothing) as they are read."""
    token = _ACTIVE.set(check)
    try:
        yield check
    finally:
        _ACTIVE.reset(token)


def read_checked(path, read: Callable[[], Value]) -> Value:
    """`read()` (which reads the file `path`); when `path` is a file of the active check, the file is
    hashed in a thread meanwhile and compared with its manifest entry before the value is returned
    (CheckpointVerifyError on a mismatch). An error of `read()` itself is raised as it is."""
    check = _ACTIVE.get()
    found = check.expected(path) if check is not None and isinstance(path, (str, os.PathLike)) else None
    if found is None:
        return read()
    relative, expected = found
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-read-hash") as pool:
        hashed = pool.submit(hash_file, Path(path), check.algorithm)
        value = read()
        try:
            actual = hashed.result()
        except OSError as error:
            raise CheckpointVerifyError(check.checkpoint, "unreadable", str(error), relative) from None
    check.compare(relative, expected, actual)
    return value
