"""Read side: verify a checkpoint against its manifest, find the newest valid one, check parts."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, CheckpointVerifyError, LegacyCheckpointError
from .hashing import default_hash_threads, hash_files
from .layout import list_hidden, list_published, parse_step_dir_name
from .manifest import MANIFEST_NAME, Manifest, read_manifest
from .pickles import PickleScanError, disallowed_globals

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReport:
    """What a successful verification checked; `seconds` is wall time including hashing."""

    checkpoint: Path
    step: int
    files: int
    bytes: int
    seconds: float
    algorithm: str
    digests_checked: bool = True


def list_files(root: Path) -> list[str]:
    """Every file under `root` as sorted relative posix paths, top-level manifest.json excluded.

    Symlinks to files count as files; symlinked directories are not followed.
    """
    root = Path(root)
    found = []
    for directory, _, names in os.walk(root):
        relative = Path(directory).relative_to(root).as_posix()
        for name in names:
            found.append(name if relative == "." else f"{relative}/{name}")
    return sorted(path for path in found if path != MANIFEST_NAME)


def load_manifest_for_verify(checkpoint_dir: Path) -> Manifest:
    """The manifest, with every way of not having a usable one raised as CheckpointVerifyError."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointVerifyError(checkpoint_dir, "not a directory", "missing or not a folder")
    try:
        manifest = read_manifest(checkpoint_dir)
    except CheckpointError as error:
        raise CheckpointVerifyError(checkpoint_dir, "bad manifest", str(error), MANIFEST_NAME) from error
    if manifest is None:
        raise LegacyCheckpointError(checkpoint_dir)
    return manifest


def check_folder_step(checkpoint_dir: Path, manifest: Manifest) -> None:
    """A `step_<N>` folder's manifest must say step N (a copied or renamed folder would resume at the wrong step)."""
    folder_step = parse_step_dir_name(Path(checkpoint_dir).name)
    if folder_step is not None and folder_step != manifest.step:
        raise CheckpointVerifyError(
            checkpoint_dir,
            "step mismatch",
            f"the manifest says step {manifest.step}, the folder name step {folder_step}",
            MANIFEST_NAME,
        )


def verify_checkpoint(
    checkpoint_dir: Path,
    *,
    hash_threads: int | None = None,
    digests: bool = True,
    hash_later: Collection[str] = (),
) -> VerifyReport:
    """Check every file of a checkpoint against its manifest; raise on the first bad file.

    Cheap checks run first over all files in sorted order (missing, unexpected extra file, not a
    regular file, wrong size), then digests and the pickle scan (both skipped with `digests=False`:
    `verify --quick`), so a wrong size anywhere is reported before a wrong digest. `hash_later`: files
    whose digests the caller compares as it reads them (`read_check`): sized and scanned here, not hashed
    (`VerifyReport.files` and `bytes` count what was hashed). A `step_<N>`
    folder's manifest must say step N. The scan refuses a pickle (a torch file, or one embedded in
    JSON as base64) naming any global outside `pickles`' allow-lists: loading it would run code.
    Raises CheckpointVerifyError (LegacyCheckpointError when there is no manifest.json).
    """
    started = time.monotonic()
    checkpoint_dir = Path(checkpoint_dir)
    manifest = load_manifest_for_verify(checkpoint_dir)
    check_folder_step(checkpoint_dir, manifest)
    on_disk = set(list_files(checkpoint_dir))
    for path in sorted(on_disk | set(manifest.files)):
        if path not in on_disk:
            raise CheckpointVerifyError(checkpoint_dir, "missing", "listed in the manifest but absent", path)
        if path not in manifest.files:
            raise CheckpointVerifyError(checkpoint_dir, "unexpected file", "present but not in the manifest", path)
        try:
            status = (checkpoint_dir / path).stat()
        except OSError as error:
            raise CheckpointVerifyError(checkpoint_dir, "missing", f"cannot stat: {error}", path) from error
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block the reader forever, a device never end
            detail = "a FIFO, socket or device, not a regular file: refused (reading it could block or never end)"
            raise CheckpointVerifyError(checkpoint_dir, "special file", detail, path)
        size = status.st_size
        if size != manifest.files[path].size:
            detail = f"{size} bytes on disk, {manifest.files[path].size} in the manifest"
            raise CheckpointVerifyError(checkpoint_dir, "wrong size", detail, path)
    hashed = sorted(set(manifest.files) - set(hash_later)) if digests else []
    if digests:
        ordered = sorted(manifest.files)
        threads = hash_threads or default_hash_threads()
        try:
            actual = hash_files(checkpoint_dir, hashed, manifest.hash_algorithm, threads=threads)
        except OSError as error:
            bad = Path(os.path.relpath(error.filename, checkpoint_dir)).as_posix() if error.filename else None
            raise CheckpointVerifyError(checkpoint_dir, "unreadable", str(error), bad) from error
        except CheckpointError as error:  # e.g. xxh3_128 without the xxhash package
            raise CheckpointVerifyError(checkpoint_dir, "bad manifest", str(error), MANIFEST_NAME) from error
        for path in hashed:
            expected = manifest.files[path]
            if actual[path] != expected:
                detail = f"{manifest.hash_algorithm} {actual[path].digest}, manifest says {expected.digest}"
                raise CheckpointVerifyError(checkpoint_dir, "wrong digest", detail, path)
        scan_pickles(checkpoint_dir, ordered)
    return VerifyReport(
        checkpoint=checkpoint_dir,
        step=manifest.step,
        files=len(hashed) if digests else len(manifest.files),
        bytes=sum(manifest.files[path].size for path in hashed) if digests else manifest.total_bytes,
        seconds=time.monotonic() - started,
        algorithm=manifest.hash_algorithm,
        digests_checked=digests,
    )


def scan_pickles(checkpoint_dir: Path, paths: Iterable[str]) -> None:
    """Refuse (CheckpointVerifyError "unsafe pickle") the first file naming code in its pickles; only their
    opcodes are read, nothing is unpickled. A pickle that does not parse is "unreadable"."""
    for path in paths:
        try:
            if not stat.S_ISREG((Path(checkpoint_dir) / path).stat().st_mode):  # never opened: a FIFO would block
                detail = "a FIFO, socket or device, not a regular file: refused"
                raise CheckpointVerifyError(checkpoint_dir, "special file", detail, path)
            code = disallowed_globals(Path(checkpoint_dir) / path)
        except (PickleScanError, OSError) as error:
            detail = f"its pickle does not parse ({error})"
            raise CheckpointVerifyError(checkpoint_dir, "unreadable", detail, path) from None
        if code:
            detail = (
                f"holds a pickle naming {', '.join(code)}, which is code, not checkpoint data: "
                "refused (loading it would run it)"
            )
            raise CheckpointVerifyError(checkpoint_dir, "unsafe pickle", detail, path)


def find_latest(
    checkpoints_dir: Path, *, verify: bool = False, hash_threads: int | None = None, before: int | None = None
) -> Path | None:
    """The published checkpoint with the highest step (below `before`, when given) whose manifest reads
    (and verifies, if asked).

    Invalid ones are skipped with a logged warning. Staging and retired directories are never
    returned; a step that exists only as a retired directory (a republish interrupted between its
    two renames) is reported with a warning: `cleanup_stale()` renames it back, so run it first.
    A legacy directory (no manifest.json) counts, with a warning, and cannot be verified.
    Returns None when there is no usable checkpoint (or no folder at all).
    """
    published = list_published(checkpoints_dir)
    _warn_about_recoverable(checkpoints_dir, {step for step, _ in published})
    for step, path in reversed(published):
        if before is not None and step >= before:
            continue
        try:
            manifest = read_manifest(path)
            if manifest is None:
                logger.warning("%s has no manifest.json: loading it as a legacy checkpoint (cannot be verified)", path)
                return path
            if manifest.step != step:
                raise CheckpointError(f"{path}: manifest says step {manifest.step}, the directory name says {step}")
            if verify:
                verify_checkpoint(path, hash_threads=hash_threads)
            return path
        except CheckpointError as error:
            logger.warning("skipping checkpoint %s: %s", path, error)
    return None


def _warn_about_recoverable(checkpoints_dir: Path, published_steps: set[int]) -> None:
    for kind, step, path in list_hidden(checkpoints_dir):
        if kind == "retired" and step not in published_steps and (path / MANIFEST_NAME).is_file():
            logger.warning(
                "checkpoint step %d exists only as %s (a republish was interrupted); "
                "cleanup_stale() restores it, run it before looking for the latest checkpoint",
                step,
                path,
            )


def require_parts(checkpoint_dir: Path, parts: Iterable[str]) -> None:
    """Raise CheckpointError naming every part of `parts` the checkpoint lacks.

    Parts are read from the manifest; for a legacy checkpoint, a part is present when a
    file or folder of that name exists at its top level.
    """
    checkpoint_dir = Path(checkpoint_dir)
    wanted = list(parts)
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        missing = [part for part in wanted if not (checkpoint_dir / part).exists()]
    else:
        missing = [part for part in wanted if part not in manifest.parts]
    if missing:
        have = sorted(manifest.parts) if manifest else "legacy checkpoint, no manifest"
        raise CheckpointError(
            f"checkpoint {checkpoint_dir} lacks the part(s) {', '.join(missing)} this job needs (it has: {have})"
        )
