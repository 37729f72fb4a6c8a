"""Phase 6 of a save, on rank 0: make the complete staging directory the published `step_<N>`.

Manifest last, every staging directory fsynced, the caller's `pre_publish`, then one atomic rename
and an fsync of the parent. Republishing an existing step_<N>: rename it to
`.step_<N>.retired-<id>`, rename staging to step_<N>, fsync the parent, delete the retired one. A crash
between the two renames leaves only the retired copy, which `cleanup_stale()` renames back; a
failure of the second rename puts it back at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from . import fs
from .errors import CheckpointError
from .layout import retired_dir_name, step_dir_name
from .manifest import Manifest, write_manifest
from .outcomes import describe_error
from .retention import delete_retired

logger = logging.getLogger("astrai.checkpoint.publisher")  # the publisher's log lines, whichever module says them


def publish_staging(
    checkpoints_dir: Path,
    staging: Path,
    step: int,
    manifest: Manifest,
    pre_publish: Callable[[], None] | None,
    *,
    renamed: Callable[[], None],
) -> Path:
    """Publish `staging` as `checkpoints_dir/step_<step>` (see the module docstring) and return that path.
    `renamed()` is called as soon as the staging directory has become the checkpoint."""
    write_manifest(staging, manifest)
    for directory, _, _ in os.walk(staging, topdown=False):
        if Path(directory) != staging:
            fs.fsync_dir(Path(directory))
    if pre_publish is not None:
        pre_publish()
    final = checkpoints_dir / step_dir_name(step)
    if not os.path.lexists(final):
        fs.rename(staging, final)
        renamed()
        sync_parent(checkpoints_dir, final)
        return final
    retired = checkpoints_dir / retired_dir_name(step)
    fs.rename(final, retired)
    try:
        fs.rename(staging, final)
    except Exception:
        try:
            fs.rename(retired, final)
        except OSError as error:
            logger.error("could not restore %s from %s (%s); cleanup_stale() restores it", final, retired, error)
        raise
    renamed()
    sync_parent(checkpoints_dir, final)
    try:
        delete_retired(retired)
    except OSError as error:
        logger.warning("could not delete the replaced checkpoint %s (%s); cleanup_stale() will", retired, error)
    return final


def sync_parent(checkpoints_dir: Path, published: Path) -> None:
    """fsync the folder of the checkpoints after the publishing rename; a failure is an error that says
    the checkpoint exists but may not survive a power loss."""
    try:
        fs.fsync_dir(checkpoints_dir)
    except OSError as error:
        raise CheckpointError(
            f"{published} was published, but syncing {checkpoints_dir} failed "
            f"({describe_error(error)}); it may not survive a power loss"
        ) from error
