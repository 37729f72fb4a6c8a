"""Removing checkpoints without ever leaving a half-deleted one under a published name.

A published directory is deleted in three durable steps: rename it to a hidden
`.step_<N>.retired-<id>` (atomic; it stops being a checkpoint at once), remove its
manifest.json and fsync (so a crash during the slow rmtree can never leave something that
looks complete), then rmtree. `cleanup_stale()` finishes whatever a crash interrupted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import fs
from .errors import CheckpointError
from .layout import DERIVED_DIRS, list_hidden, list_published, retired_dir_name, step_dir_name
from .manifest import MANIFEST_NAME, read_manifest
from .verify import verify_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class CleanupReport:
    """What `cleanup_stale` did: hidden directories removed, and retired ones restored as published."""

    removed: list[Path] = field(default_factory=list)
    recovered: list[Path] = field(default_factory=list)


def delete_retired(retired: Path) -> None:
    """Delete a hidden retired directory: its manifest first (durably), then everything else."""
    manifest = retired / MANIFEST_NAME
    if manifest.exists():
        fs.remove_file(manifest)
        fs.fsync_dir(retired)
    fs.remove_tree(retired)


def remove_checkpoint(path: Path, step: int) -> Path:
    """Retire then delete one published checkpoint; returns the retired path it went through."""
    retired = path.parent / retired_dir_name(step)
    fs.rename(path, retired)
    fs.fsync_dir(path.parent)
    delete_retired(retired)
    return retired


def recorded_value(manifest, metric: str) -> float | None:
    """`manifest.meta["eval"][metric]` when it is a finite number, else None (not a candidate for best)."""
    figures = manifest.meta.get("eval") if isinstance(manifest.meta, dict) else None
    value = figures.get(metric) if isinstance(figures, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_checkpoint(checkpoints_dir: Path, metric: str, mode: str) -> tuple[int, Path, float] | None:
    """(step, path, value) of the published checkpoint whose manifest records the best value of `metric`
    (`mode` "min" or "max"; on a tie the earliest step), or None when no manifest records it.

    The choice is made from the manifests alone, each time: nothing else records it, so no crash can leave
    a stale record of the best, and a checkpoint is never deleted as "not the best" by a half-done update."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    best = None
    for step, path in list_published(Path(checkpoints_dir)):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        value = recorded_value(manifest, metric) if manifest is not None and manifest.step == step else None
        if value is None:
            continue
        if best is None or (value < best[2] if mode == "min" else value > best[2]):
            best = (step, path, value)
    return best


def apply_retention(
    checkpoints_dir: Path, keep_last: int, protect: Path, best: tuple[str, str] | None = None
) -> list[Path]:
    """Delete AstrAI checkpoints beyond the `keep_last` newest; return the deleted paths.

    Only directories whose manifest reads count and can be deleted: legacy or unreadable ones
    are left alone (we never destroy what we cannot identify). `protect` (the checkpoint just
    published) is always kept, even when older checkpoints have higher steps, and the newest
    valid checkpoint is always among the `keep_last >= 1` kept. `best` = (metric, mode): the checkpoint
    `best_checkpoint` names is kept too, beside the `keep_last` newest.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    candidates = []
    for step, path in list_published(checkpoints_dir):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest is not None and manifest.step == step:
            candidates.append((step, path))
    kept = {path for _, path in candidates[-keep_last:]} | {Path(protect)}
    if best is not None and (chosen := best_checkpoint(checkpoints_dir, *best)) is not None:
        kept.add(chosen[1])
    deleted = []
    for step, path in candidates:
        if path not in kept:
            logger.info("retention (keep_last=%d): removing checkpoint %s", keep_last, path)
            remove_checkpoint(path, step)
            deleted.append(path)
    deleted += remove_orphaned_derived(checkpoints_dir)
    return deleted


def remove_orphaned_derived(checkpoints_dir: Path) -> list[Path]:
    """Delete derived forms (`portable/step_<N>`) whose original `step_<N>` is no longer published,
    the same durable way; a derived form of a kept checkpoint stays."""
    published = {step for step, _ in list_published(checkpoints_dir)}
    deleted = []
    for folder in DERIVED_DIRS:
        for step, path in list_published(checkpoints_dir / folder):
            if step not in published:
                logger.info("retention: removing %s (its checkpoint step_%d is gone)", path, step)
                remove_checkpoint(path, step)
                deleted.append(path)
    return deleted


def _restorable(path: Path, step: int) -> bool:
    """A retired directory is restorable when its manifest reads and every file has its listed size."""
    try:
        manifest = read_manifest(path)
        if manifest is None or manifest.step != step:
            return False
        verify_checkpoint(path, digests=False)
        return True
    except CheckpointError:
        return False


def cleanup_stale(checkpoints_dir: Path) -> CleanupReport:
    """Remove leftover staging/retired directories; restore an interrupted republish.

    Run on one process (rank 0) at start, before any publish into this folder: it deletes
    every staging directory, including one another live process would be writing.
    A `.step_<N>.retired-*` directory whose manifest reads and whose files are all present is
    renamed back to `step_<N>` when no published step N exists: that is the state a crash
    between the two renames of a republish leaves. Deletions retire the manifest first, so a
    half-deleted directory never qualifies.
    """
    checkpoints_dir = Path(checkpoints_dir)
    report = CleanupReport()
    published_steps = {step for step, _ in list_published(checkpoints_dir)}
    for kind, step, path in list_hidden(checkpoints_dir):
        if kind == "retired" and step not in published_steps and _restorable(path, step):
            restored = checkpoints_dir / step_dir_name(step)
            logger.warning("restoring %s to %s (a republish was interrupted)", path, restored)
            fs.rename(path, restored)
            fs.fsync_dir(checkpoints_dir)
            published_steps.add(step)
            report.recovered.append(restored)
            continue
        logger.info("removing stale %s directory %s", kind, path)
        if kind == "retired":
            delete_retired(path)
        else:
            fs.remove_tree(path)
        report.removed.append(path)
    if report.removed:
        fs.fsync_dir(checkpoints_dir)
    return report
