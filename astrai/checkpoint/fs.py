"""Every filesystem call whose order or failure matters for crash safety.

Why a module of one-liners: tests replace these names with recording or failing wrappers
(`monkeypatch.setattr(fs, "rename", wrapper)`) to assert the order of operations (every file
fsynced before the publishing rename, manifest written last, parent fsynced after the rename)
and to inject EIO or ENOSPC. So the rest of the package calls them as `fs.rename(...)`, never
`from .fs import rename`, which would bypass the wrappers; and the helpers below call each
other through module globals for the same reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path


def write_bytes(path: Path, data: bytes) -> None:
    """Create or truncate `path` and write `data` with unbuffered os.write calls.

    Unbuffered so that ENOSPC/EFBIG surface here, not later in a close() nobody checks.
    """
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(descriptor, view)
            view = view[written:]
    finally:
        os.close(descriptor)


def fsync_file(path: Path) -> None:
    """Flush a file's data and metadata to stable storage (any open file descriptor will do on Linux)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_dir(path: Path) -> None:
    """Flush a directory, making the names created, renamed or removed in it durable."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def rename(source: Path, destination: Path) -> None:
    """Atomic rename within one filesystem (POSIX rename(2))."""
    os.rename(source, destination)


def make_dir(path: Path) -> None:
    """Create one directory; fails if it exists, so two writers never share a staging dir."""
    os.mkdir(path)


def remove_file(path: Path) -> None:
    os.unlink(path)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either no file or the whole of it, durably.

    Temporary name in the same directory -> fsync -> rename -> fsync of the directory.
    """
    path = Path(path)
    temporary = path.with_name(f"{path.name}.tmp")
    write_bytes(temporary, data)
    fsync_file(temporary)
    rename(temporary, path)
    fsync_dir(path.parent)


@functools.cache
def _sync_file_range():
    """libc's sync_file_range (Linux only), or None. Looked up at first use: ctypes stays out of imports."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range  # the process's own C library
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-out of the range's dirty pages, do not wait for it


def start_writeback(descriptor: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing `length` bytes at `offset` of an open file to the disk, without
    waiting for it. Advice only: durability still comes from `fsync_file`, which also reports any
    write error. Returns whether the request was taken (False where sync_file_range is missing or
    refused, e.g. by a filesystem without it; the later fsync then does all the work).
    """
    function = _sync_file_range()
    return function is not None and function(descriptor, offset, length, _SYNC_FILE_RANGE_WRITE) == 0
