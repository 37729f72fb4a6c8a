"""Checkpoint files written in one pass: hashed as the bytes go out, and sent to the disk while the
rest of the file is still being serialised.

Why: a plain `torch.save` returns when its bytes are in the page cache. A crash-safe publish then
fsyncs every file (the kernel only now starts writing it out, so the whole file waits on the disk)
and reads every file back to hash it. Written through a `StreamedFile` instead, the kernel is asked
to start writing each `WRITEBACK_BYTES` slice out as soon as it is written (`sync_file_range`
on Linux), so the disk works while the serialiser goes on and the fsync at publish time only waits
for the tail; and the digest is computed from the bytes on their way out, so the publisher does
not read the file back. A save that used to be "serialise, then write out, then read and hash"
becomes one pass, as fast as the slower of the serialiser and the disk.

The writer is sequential and non-seekable on purpose: every byte of the file passes through
`write`, in order, so the digest is the digest of the file. It does not fsync: the publisher
fsyncs every file before the manifest is written, whoever wrote it.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Callable

from . import fs
from .hashing import FileDigest, new_hasher

WRITEBACK_BYTES = 16 * 1024 * 1024  # large enough for the disk's sequential speed, small next to a shard


class StreamedFile(io.RawIOBase):
    """A write-only file that hashes what it writes (with `algorithm`, or not at all when None) and
    starts the kernel's write-out of every `writeback_bytes` written.

    `digest` is the size and digest of the whole file once it is closed after successful writes; it
    stays None after a failed write, so a partial file is never described as a complete one.
    `on_digest(file)` is called once that digest exists.
    """

    def __init__(
        self, path: str | Path, algorithm: str | None, *, writeback_bytes: int = WRITEBACK_BYTES,
        on_digest: Callable[["StreamedFile"], None] | None = None,
    ):
        super().__init__()
        if writeback_bytes <= 0:
            raise ValueError(f"writeback_bytes must be > 0, got {writeback_bytes}")
        self.path = Path(path)
        self.digest: FileDigest | None = None
        self._hasher = new_hasher(algorithm) if algorithm else None
        self._writeback_bytes = writeback_bytes
        self._size = 0
        self._written_back = 0  # bytes whose write-out has been started
        self._failed = False
        self._on_digest = on_digest
        self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.closed:
            raise ValueError(f"write to closed checkpoint file {self.path}")
        view = memoryview(data).cast("B")
        try:
            # Slices, so that one large tensor written in a single call still streams to the disk.
            for start in range(0, len(view), self._writeback_bytes):
                piece = view[start : start + self._writeback_bytes]
                if self._hasher is not None:
                    self._hasher.update(piece)
                while piece:
                    written = os.write(self._descriptor, piece)
                    piece = piece[written:]
                self._size += min(self._writeback_bytes, len(view) - start)
                if self._size - self._written_back >= self._writeback_bytes:
                    fs.start_writeback(self._descriptor, self._written_back, self._size - self._written_back)
                    self._written_back = self._size
        except BaseException:
            self._failed = True
            raise
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._failed and self._size > self._written_back:
                fs.start_writeback(self._descriptor, self._written_back, self._size - self._written_back)
        finally:
            os.close(self._descriptor)
            super().close()
        if not self._failed and self._hasher is not None:
            self.digest = FileDigest(size=self._size, digest=self._hasher.hexdigest())
            if self._on_digest is not None:
                self._on_digest(self)


class StreamedFiles:
    """The files of one save written through `open`: hands out `StreamedFile`s and keeps their digests
    for the publisher (`digests_under(staging)`), so it can skip reading those files back.

    `algorithm` must be the publisher's; None streams the writes without hashing (an asynchronous
    save, whose hashing runs in the background rather than while training waits). Thread-safe.
    """

    def __init__(self, algorithm: str | None, *, writeback_bytes: int = WRITEBACK_BYTES):
        if algorithm is not None:
            new_hasher(algorithm)  # an unknown algorithm fails before any file is written
        self.algorithm = algorithm
        self._writeback_bytes = writeback_bytes
        self._digests: dict[Path, FileDigest] = {}
        self._lock = threading.Lock()

    def open(self, path: str | Path) -> StreamedFile:
        """A new file at `path`, recorded once it is closed after successful writes."""
        return StreamedFile(path, self.algorithm, writeback_bytes=self._writeback_bytes, on_digest=self._record)

    def _record(self, file: StreamedFile) -> None:
        with self._lock:
            self._digests[Path(os.path.abspath(file.path))] = file.digest

    def digests_under(self, root: str | Path) -> dict[str, FileDigest]:
        """Digests of the recorded files under `root`, keyed by their POSIX path relative to it."""
        root = Path(os.path.abspath(root))
        with self._lock:
            return {
                path.relative_to(root).as_posix(): digest
                for path, digest in self._digests.items()
                if path.is_relative_to(root)
            }
