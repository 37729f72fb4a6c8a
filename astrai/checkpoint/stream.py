"""Checkpoint files written in one pass: sent to the disk and hashed while the rest of the file is
still being serialised.

Why: a plain `torch.save` returns when its bytes are in the page cache. A crash-safe publish then
fsyncs every file (only now does the kernel start writing it out, so the whole file waits on the
disk) and reads every file back to hash it: serialise, then write out, then hash, one after the
other. Written through a `StreamedFile`, the three overlap:
- every `WRITEBACK_BYTES` written, the kernel is asked to start writing that slice to the disk
  (`sync_file_range` on Linux), so the disk works while the serialiser goes on and the publisher's
  fsync only waits for the tail;
- a hashing thread follows the writer through the file, reading each slice back from the page
  cache just after it is written (a memory copy) and hashing it. hashlib releases the GIL, so the
  hash runs on another core, or in the time the writer waits on the disk. It reads the file rather
  than hashing the writer's buffers because those belong to the serialiser (torch frees a tensor's
  temporary CPU copy as soon as `write` returns), and because the digest should be that of the
  bytes in the file, as `verify` will compute it.
The publisher then only fsyncs these files and checks their size (`hashing.confirm_known`).

The writer is sequential and non-seekable on purpose: every byte of the file passes through `write`,
in order. It does not fsync: the publisher fsyncs every file before the manifest is written.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from pathlib import Path

from . import fs
from .hashing import CHUNK_BYTES, FileDigest, new_hasher

WRITEBACK_BYTES = 16 * 1024 * 1024  # large enough for the disk's sequential speed, small next to a shard


class _FollowingHasher:
    """A thread hashing a file from its start up to the size the writer reports, as the writer goes on."""

    def __init__(self, path: Path, algorithm: str):
        self._hasher = new_hasher(algorithm)
        self._reader = open(path, "rb", buffering=0)  # sequential: the hash never reads past what is written
        self._written = 0  # bytes the writer has written so far
        self._closing = False
        self._abandoned = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="checkpoint-stream-hash", daemon=True)
        self._thread.start()

    def advance(self, written: int) -> None:
        with self._changed:
            self._written = written
            self._changed.notify()

    def finish(self, written: int) -> str:
        """Hash up to `written` bytes, stop the thread, return the hex digest (or raise the thread's error)."""
        self.stop(written)
        if self._error is not None:
            raise self._error
        return self._hasher.hexdigest()

    def stop(self, written: int | None = None) -> None:
        """End the thread: after hashing up to `written`, or at once when None (the write failed)."""
        with self._changed:
            if written is None:
                self._abandoned = True
            else:
                self._written = written
            self._closing = True
            self._changed.notify()
        self._thread.join()
        self._reader.close()

    def _run(self) -> None:
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        hashed = 0
        try:
            while True:
                with self._changed:
                    while self._written == hashed and not self._closing:
                        self._changed.wait()
                    target, closing = self._written, self._closing
                    if self._abandoned:
                        return
                while hashed < target:
                    count = self._reader.readinto(view[: min(CHUNK_BYTES, target - hashed)])
                    if count == 0:
                        raise OSError(f"{target - hashed} written bytes of the file could not be read back")
                    self._hasher.update(view[:count])
                    hashed += count
                if closing and hashed == self._written:
                    return
        except BaseException as error:  # kept for finish(), raised in the writer's thread
            self._error = error


class StreamedFile(io.RawIOBase):
    """A write-only file that starts the kernel's write-out of every `writeback_bytes` written and, given
    an `algorithm`, hashes its bytes in a thread that follows the writer (see the module docstring).

    `digest` is the size and digest of the whole file once it is closed after successful writes; it
    stays None after a failed write, after an exception inside its `with` block, and without an
    algorithm, so a partial file is never described as a complete one. `on_digest(file)` is called once
    that digest exists.
    """

    def __init__(
        self,
        path: str | Path,
        algorithm: str | None,
        *,
        writeback_bytes: int = WRITEBACK_BYTES,
        on_digest: Callable[[StreamedFile], None] | None = None,
    ):
        super().__init__()
        if writeback_bytes <= 0:
            raise ValueError(f"writeback_bytes must be > 0, got {writeback_bytes}")
        if algorithm is not None:
            new_hasher(algorithm)  # an unknown algorithm fails before the file is created
        self.path = Path(path)
        self.digest: FileDigest | None = None
        self._writeback_bytes = writeback_bytes
        self._size = 0
        self._written_back = 0  # bytes whose write-out has been started
        self._failed = False
        self._on_digest = on_digest
        self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hasher = _FollowingHasher(self.path, algorithm) if algorithm is not None else None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.closed:
            raise ValueError(f"write to closed checkpoint file {self.path}")
        view = memoryview(data).cast("B")
        try:
            # Slices, so that one large tensor written in a single call still streams to the disk and the hasher.
            for start in range(0, len(view), self._writeback_bytes):
                piece = view[start : start + self._writeback_bytes]
                while piece:
                    written = os.write(self._descriptor, piece)
                    piece = piece[written:]
                    self._size += written
                if self._size - self._written_back >= self._writeback_bytes:
                    self._start_writeback()
                    if self._hasher is not None:
                        self._hasher.advance(self._size)
        except BaseException:
            self._failed = True
            raise
        return len(view)

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:  # the serialiser failed between writes: what is on disk is not the whole file
            self._failed = True
        return super().__exit__(exc_type, exc, traceback)

    def _start_writeback(self) -> None:
        fs.start_writeback(self._descriptor, self._written_back, self._size - self._written_back)
        self._written_back = self._size

    def close(self) -> None:
        if self.closed:
            return
        digest = None
        try:
            if not self._failed and self._size > self._written_back:
                self._start_writeback()
        finally:
            os.close(self._descriptor)
            super().close()
            if self._hasher is not None:
                if self._failed:
                    self._hasher.stop()
                else:
                    digest = self._hasher.finish(self._size)
        if digest is not None:
            self.digest = FileDigest(size=self._size, digest=digest)
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
