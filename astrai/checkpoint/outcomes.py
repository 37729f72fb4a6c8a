"""What the ranks of a save tell each other, described and checked: one line per error (with a hint for
storage errnos), how two ranks' staging listings differ, and whether the digests the write callbacks
reported name files of the agreed listing, each reported by one rank."""

from __future__ import annotations

import errno
from collections.abc import Sequence

from .errors import CheckpointError
from .hashing import FileDigest

_ERRNO_HINTS = {
    errno.ENOSPC: "out of disk space: free space or lower checkpoint.keep_last",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached (ulimit -f) or file too large for the filesystem",
    errno.EIO: "I/O error reported by the storage: check the disk or filesystem",
    errno.EROFS: "the filesystem is read-only",
}


def describe_error(error: BaseException) -> str:
    """One line naming the exception type and message, with a hint for storage errnos."""
    text = f"{type(error).__name__}: {error}"
    hint = _ERRNO_HINTS.get(getattr(error, "errno", None))
    return f"{text} ({hint})" if hint else text


def describe_listing_difference(listings: Sequence[Sequence[str]]) -> str | None:
    """None when every rank listed the same files, else which rank differs from rank 0 and how."""
    reference = set(listings[0])
    for rank, listing in enumerate(listings[1:], start=1):
        if list(listing) != list(listings[0]):
            missing = sorted(reference - set(listing))[:5]
            extra = sorted(set(listing) - reference)[:5]
            return (
                f"rank {rank} sees different files than rank 0 in the staging directory: "
                f"missing {missing}, extra {extra}"
            )
    return None


def check_reported_digests(context: str, listing: Sequence[str], known: Sequence[dict]) -> None:
    """`known[rank]`: the digests rank `rank`'s write callback reported. Each must name a file of the
    agreed `listing` and be a FileDigest, and no file may be reported by two ranks; else every rank
    (all hold the same gathered reports) raises the same CheckpointError."""
    listed, reported_by = set(listing), {}
    for rank, digests in enumerate(known):
        for path, digest in digests.items():
            if path not in listed or not isinstance(digest, FileDigest):
                raise CheckpointError(
                    f"{context}: the write callback on rank {rank} reported a digest for {path!r}, "
                    "which is not a file of the staging directory; nothing was published"
                )
            if path in reported_by:
                raise CheckpointError(
                    f"{context}: ranks {reported_by[path]} and {rank} both report writing {path!r}; nothing was "
                    "published"
                )
            reported_by[path] = rank
