"""File digests for manifests: sha256 (the job's and the publisher's default), xxh3_128 (the `xxhash`
package, a dependency), blake2b.

Files are read in 8 MiB chunks into one reused buffer; hashlib (and xxhash) release the GIL
while hashing large buffers, so a thread pool scales over files on one rank without processes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import fs
from .errors import CheckpointError

logger = logging.getLogger(__name__)

HASH_ALGORITHMS = ("sha256", "blake2b", "xxh3_128")
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and hex digest of one file."""

    size: int
    digest: str


def default_hash_threads() -> int:
    """Threads used to hash one rank's files when the caller does not say."""
    return max(1, min(8, os.cpu_count() or 1))


def new_hasher(algorithm: str):
    """A fresh hash object for `algorithm`; a clear CheckpointError for unknown or unavailable ones."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake2b":
        return hashlib.blake2b()
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as error:
            raise CheckpointError(
                "hash 'xxh3_128' needs the xxhash package: pip install xxhash (or pick checkpoint.hash: sha256)"
            ) from error
        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown hash algorithm {algorithm!r}; this AstrAI knows {', '.join(HASH_ALGORITHMS)}")


def hash_file(path: Path, algorithm: str, *, fsync: bool = False) -> FileDigest:
    """Size and digest of one file; with `fsync`, also flushed to stable storage before this returns.

    The fsync runs in a thread of its own while this one reads the file back from the page cache and
    hashes it: the one waits on the disk, the other on a core, so a save pays max(fsync, hash) rather
    than their sum. Either failure is raised, and only once both have finished, so nothing that
    follows (the manifest, the publishing rename) can start before the file is durable.
    """
    if not fsync:
        return _digest(path, algorithm)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-fsync") as flusher:
        flushed = flusher.submit(fs.fsync_file, path)
        try:
            digest = _digest(path, algorithm)
        finally:
            error = flushed.exception()  # waits for the fsync, success or not
        if error is not None:
            raise error
    return digest


def _digest(path: Path, algorithm: str) -> FileDigest:
    hasher = new_hasher(algorithm)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            hasher.update(view[:count])
            size += count
    return FileDigest(size=size, digest=hasher.hexdigest())


def confirm_known(path: Path, known: FileDigest, algorithm: str, *, fsync: bool = False) -> FileDigest:
    """A file hashed while it was written (`stream.StreamedFile`): fsynced (with `fsync`), and its digest
    kept when the file still has the size that was hashed. Any other size means something wrote to it
    since, so it is hashed again from disk (with a warning): the manifest describes the bytes on disk."""
    if fsync:
        fs.fsync_file(path)
    size = os.stat(path).st_size
    if size == known.size:
        return known
    logger.warning(
        "%s changed size after it was hashed while written (%d -> %d bytes); hashing it again", path, known.size, size
    )
    return _digest(path, algorithm)


def hash_files(
    root: Path,
    relative_paths: list[str],
    algorithm: str,
    *,
    threads: int,
    fsync: bool = False,
    known: dict[str, FileDigest] | None = None,
) -> dict[str, FileDigest]:
    """Digests of `root/<relative path>` for each path, hashed `threads` at a time.

    `known`: digests (with `algorithm`) of files hashed while they were written; those are only
    fsynced and their size checked (`confirm_known`), not read back.
    The first failure (in the order of `relative_paths`) is raised after running work finishes.
    """
    new_hasher(algorithm)  # fail on an unknown algorithm before starting threads
    if not relative_paths:
        return {}
    root, known = Path(root), known or {}

    def one(relative: str) -> FileDigest:
        if relative in known:
            return confirm_known(root / relative, known[relative], algorithm, fsync=fsync)
        return hash_file(root / relative, algorithm, fsync=fsync)

    workers = max(1, min(threads, len(relative_paths)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-hash") as pool:
        return dict(zip(relative_paths, pool.map(one, relative_paths)))
