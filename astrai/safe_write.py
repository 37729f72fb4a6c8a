"""Crash-safe writes outside checkpoints: a file replaced atomically, a folder installed by rename.

Readers (and a process restarted after a crash or a power loss) see the old content or the new, never
a mix and never a half-written file:

- `write_file_atomic`: a temporary file in the same folder -> fsync -> os.replace -> fsync of the folder.
- `install_folder`: a hidden staging folder beside the destination, filled by the caller -> fsync of
  every file and folder in it -> the swap: an earlier destination renamed aside (`retired`), staging
  renamed in, the parent fsynced, the retired one removed. A failure of the second rename puts the
  earlier one back.

Used by export/, observability/metrics.py, launch/multinode.py, launch/preflight.py, eval/ and
models/tokenizer.py. The checkpoint
publisher keeps its own copy of these steps in checkpoint/fs.py and checkpoint/install.py: its crash
tests replace each step there (`fs.rename`, `fs.fsync_dir`) to assert their order and inject faults,
and its retired folders follow the checkpoint layout (`cleanup_stale()` restores them). Standard
library only, so the launcher and the per-rank preflight import it before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """A file's or a folder's data and entry on stable storage."""
    descriptor = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(folder: Path) -> None:
    """Every file and folder under `folder` (itself included) on stable storage."""
    for directory, _, names in os.walk(folder):
        for name in names:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))


def write_file_atomic(path: Path, content: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `content` so that readers see the old file or the whole new one, durably.

    The temporary name carries host and pid: nodes sharing a folder (launch with no_ssh) or ranks
    writing the same name never write into one temporary file. It never outlives a failure.
    `durable=False` skips both fsyncs (still atomic for readers and for a killed process; a power loss
    may keep the old content): for files rewritten every step, made durable at the next checkpoint."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    data = content.encode() if isinstance(content, str) else content
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable:
        fsync_path(path.parent)


def staging_path(destination: Path) -> Path:
    """A fresh hidden staging name beside `destination` (`.<name>.staging-<hex>`: never the destination's name)."""
    return destination.with_name(f".{destination.name}.staging-{uuid.uuid4().hex}")


def stale_staging(destination: Path) -> list[Path]:
    """Staging folders that earlier, interrupted installs to `destination` left behind."""
    return sorted(destination.parent.glob(f".{destination.name}.staging-*"))


def swap_in(staging: Path, destination: Path) -> None:
    """Make the (complete, fsynced) `staging` folder the destination by rename. Replacing: the old one
    aside, the new one in, the old one removed, so that the destination name always holds one
    complete folder (or, for an instant, none); a failed rename puts the old one back."""
    retired = None
    if os.path.lexists(destination):
        if destination.is_dir() and not destination.is_symlink() and not any(destination.iterdir()):
            destination.rmdir()
        else:
            retired = destination.with_name(f".{destination.name}.retired-{uuid.uuid4().hex}")
            os.rename(destination, retired)
    try:
        os.rename(staging, destination)
    except BaseException:
        if retired is not None:  # put the earlier folder back rather than leave no destination
            os.rename(retired, destination)
        raise
    fsync_path(destination.parent)
    if retired is not None:
        if retired.is_dir() and not retired.is_symlink():
            shutil.rmtree(retired)
        else:
            os.unlink(retired)


@contextlib.contextmanager
def staging_folder(destination: Path) -> Iterator[Path]:
    """A new, empty staging folder beside `destination`, removed if the block fails."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(destination)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def install_folder(destination: Path, write: Callable[[Path], None]) -> None:
    """`write(staging)` fills a staging folder beside `destination`, which then replaces the
    destination (fsync of the tree, retire-then-rename swap). On any failure the staging folder goes
    and the destination is as it was."""
    destination = Path(destination)
    with staging_folder(destination) as staging:
        write(staging)
        fsync_tree(staging)
        swap_in(staging, destination)
