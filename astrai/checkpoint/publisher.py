"""CheckpointPublisher: crash-safe, multi-rank publishing of one checkpoint directory.

`publish(step, write)` runs six phases; each ends with an exchange over the checkpoint group,
so every rank learns every other rank's failure and all raise the same CheckpointError:

1. create-staging   rank 0 makes `.step_<N>.staging-<id>` (+ a marker file); name and steps gathered
2. shared-storage   every other rank must see the marker: checkpoint storage must be shared
3. write            every rank runs the caller's `write(staging_dir)`
4. gather-listing   every rank lists the staging files; all listings must agree
5. hash             every file is fsynced and hashed: a file the write callback hashed while writing it
                    (`stream.StreamedFiles`) by the rank that wrote it, without reading it back; the
                    others, file i of the rest of the sorted listing, by rank i % world_size
6. publish          rank 0 writes manifest.json last, fsyncs directories, runs `pre_publish`,
                    renames staging -> step_<N> (one atomic rename) and fsyncs the parent (`install.py`)
Then rank 0 applies retention (`keep_last`).

`publish_async` runs phases 1-4 (everything that touches the caller's state: the shards are written
by then) and returns; phases 5-6 and retention run in a background thread on every rank, over the
publisher's own gloo group, while the caller goes on training. The next `publish`, `publish_async`,
`cleanup_stale` or `wait` first waits for it and raises its error, so at most one save is in flight
and a failure is never silent. Until it is published, the save is a staging directory like any
other: a crash leaves the previous checkpoint as the newest.

Failure anywhere: every rank raises CheckpointError naming the failing rank(s) and their error
(the failing rank chains its original exception), rank 0 removes the staging directory,
earlier checkpoints are untouched, nothing is retried. This module knows nothing of train
types or DeepSpeed: what goes into a checkpoint is entirely the `write` callback's business.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fs
from .collective import PhaseStalledError, open_group
from .errors import CheckpointError
from .hashing import FileDigest, default_hash_threads, hash_files, new_hasher
from .install import publish_staging
from .layout import staging_dir_name
from .manifest import MANIFEST_NAME, Manifest, is_safe_relative_path
from .outcomes import check_reported_digests, describe_error, describe_listing_difference
from .retention import CleanupReport, apply_retention, cleanup_stale
from .verify import list_files

logger = logging.getLogger(__name__)

MARKER_NAME = ".astrai-shared-storage-check"
SHARED_STORAGE_WAIT_S = 2.0  # a network filesystem may show another node's new file a little late
LISTING_ATTEMPTS = 3  # same reason: a listing that disagrees is retried after a pause before failing
_PHASES_BEFORE_PUBLISH = ("create-staging", "shared-storage", "write", "gather-listing", "hash")


@dataclass(frozen=True)
class PublishReport:
    """A published checkpoint: where, which step, its size, how long the save took (seconds, this rank),
    and which older checkpoints retention removed (rank 0 only)."""

    path: Path
    step: int
    files: int
    bytes: int
    seconds: float
    removed: tuple[Path, ...] = ()
    blocked_s: float | None = (
        None  # how long the caller waited (publish_async: phases 1-4 only; publish: all of `seconds`)
    )
    hashed_while_written: int = 0  # files whose digests came from the write callback (not read back)


@dataclass
class _Save:
    """Per-call state: the exchange group, the step, the staging directory while it exists, its agreed
    listing, and per rank the digests of the files that rank hashed while writing them."""

    group: Any
    step: int
    context: str
    staging: Path | None = None
    listing: list[str] = field(default_factory=list)
    known: list[dict[str, FileDigest]] = field(default_factory=list)


WriteCallback = Callable[[Path], "Mapping[str, FileDigest] | None"]


class _Background:
    """The one save whose phases 5-6 run in a thread: its outcome, kept until `wait` collects it."""

    def __init__(self, step: int, finish: Callable[[], PublishReport]):
        self.step = step
        self.report: PublishReport | None = None
        self.error: BaseException | None = None
        self._finish = finish
        # A daemon: a run that dies with a save in flight must not hang at exit; the save then never
        # publishes, which is what a crash means anyway (its staging directory is removed at next start).
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-publish-{step}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.report = self._finish()
        except BaseException as error:  # kept for wait(), which raises it in the caller's thread
            self.error = error


class CheckpointPublisher:
    """Publishes checkpoints into `checkpoints_dir` as `step_<N>/` directories, crash-safely.

    Args:
        checkpoints_dir: folder of the checkpoints (the same path on every rank, shared storage).
        parts: top-level names every checkpoint must contain (e.g. ("policy", "critic")); recorded in
            the manifest and checked after the write phase.
        hash_algorithm: "sha256", "blake2b" or "xxh3_128" (needs the xxhash package).
        keep_last: keep the newest K checkpoints (None keeps all); applied after each publish.
        keep_best: (metric, "min" | "max"): retention also keeps the checkpoint whose manifest records the best
            `meta["eval"][metric]` (`retention.best_checkpoint`).
        timeout_s: bound on each collective wait; a rank that is later than this fails the save.
        group: a gloo process group, or None: a dedicated gloo group over all ranks is created at
            the first call (every rank must call), or single-process mode when torch.distributed
            is not initialized.
        hash_threads: threads hashing this rank's share of files (default: min(8, CPUs)).
    Every rank must call `publish` (and `cleanup_stale`) with the same arguments in the same order.
    """

    def __init__(
        self,
        checkpoints_dir: Path,
        *,
        parts: Sequence[str] = (),
        hash_algorithm: str = "sha256",
        keep_last: int | None = None,
        keep_best: tuple[str, str] | None = None,
        timeout_s: float = 600.0,
        group: Any = None,
        hash_threads: int | None = None,
    ):
        self.checkpoints_dir = Path(checkpoints_dir)
        self.parts = tuple(parts)
        for part in self.parts:
            if not is_safe_relative_path(part) or "/" in part or part == MANIFEST_NAME:
                raise ValueError(f"a checkpoint part is a top-level file or folder name, got {part!r}")
        new_hasher(hash_algorithm)  # fail when the job is built, not at the first save
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.hash_algorithm = hash_algorithm
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.timeout_s = float(timeout_s)
        self.hash_threads = hash_threads or default_hash_threads()
        self._given_group = group
        self._group = None
        self._unusable: str | None = None
        self._background: _Background | None = None

    def _exchange_group(self):
        if self._unusable is not None:
            raise CheckpointError(
                f"the checkpoint process group is unusable after an earlier failure: {self._unusable}"
            )
        if self._group is None:
            self._group = open_group(self._given_group, self.timeout_s)
        return self._group

    def _phase(self, save: _Save, phase: str, action: Callable[[], Any]) -> list[Any]:
        """Run `action` on this rank, exchange outcomes, raise on every rank if any rank failed."""
        error, value = None, None
        try:
            value = action()
        except Exception as caught:
            error = caught
        outcome = (None if error is None else describe_error(error), value if error is None else None)
        try:
            outcomes = save.group.exchange(phase, outcome, save.context)
        except PhaseStalledError as stalled:
            self._unusable = str(stalled)
            if error is None:
                raise
            raise PhaseStalledError(f"{stalled}; this rank had failed: {describe_error(error)}") from error
        failures = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text is not None]
        if failures:
            named = "; ".join(f"on rank {rank}: {text}" for rank, text in failures)
            suffix = ""
            if phase in _PHASES_BEFORE_PUBLISH:
                suffix = "; nothing was published, earlier checkpoints are untouched"
            raise CheckpointError(f"{save.context} failed in phase '{phase}' {named}{suffix}") from error
        return [value for _, value in outcomes]

    def cleanup_stale(self) -> CleanupReport:
        """Rank 0 removes leftover staging/retired directories (see `retention.cleanup_stale`).

        Call on every rank at start, before resuming and before any publish; returns rank 0's report.
        """
        self.wait()
        group = self._exchange_group()
        save = _Save(group=group, step=-1, context=f"checkpoint cleanup of {self.checkpoints_dir}")
        reports = self._phase(
            save, "cleanup-stale", lambda: cleanup_stale(self.checkpoints_dir) if group.rank == 0 else None
        )
        return reports[0]

    @property
    def pending_step(self) -> int | None:
        """The step of the save still finishing in the background, or None."""
        return None if self._background is None else self._background.step

    def wait(self) -> PublishReport | None:
        """Wait for the background save (if any) and return its report; raise its CheckpointError.

        Every rank calls it (it is called first by every other method): the background phases
        exchange over the checkpoint group, so a rank that stopped waiting would stall the others.
        """
        background, self._background = self._background, None
        if background is None:
            return None
        background.thread.join()
        if background.error is not None:
            if isinstance(background.error, CheckpointError):
                raise CheckpointError(f"background {background.error}") from background.error
            raise CheckpointError(
                f"background checkpoint save step {background.step} failed: {describe_error(background.error)}"
            ) from background.error
        return background.report

    def publish(
        self,
        step: int,
        write: WriteCallback,
        *,
        meta: dict[str, Any] | None = None,
        pre_publish: Callable[[], None] | None = None,
    ) -> PublishReport:
        """Write, hash and atomically publish checkpoint `step` (every rank calls, with the same step).

        Returns a PublishReport: path, step, files and bytes agree on every rank; `removed`
        (retention) is filled on rank 0 only.

        `write(staging_dir)` runs on every rank and writes that rank's files under staging_dir. It may
        return the digests (made with this publisher's `hash_algorithm`, keyed by path relative to
        staging_dir) of files it hashed while writing them, e.g. `StreamedFiles.digests_under(staging_dir)`:
        those are fsynced by this rank and size-checked instead of read back and hashed. Any other return
        value is ignored.
        `meta` (JSON-serializable, rank 0's is used) goes into the manifest as is.
        `pre_publish()` runs on rank 0 after the manifest is durable, just before the publishing
        rename (the trainer flushes and fsyncs metrics.jsonl there); its failure fails the save.
        Republishing an existing step replaces it atomically (see `_install`).
        """
        self.wait()
        started = time.monotonic()
        save = self._write_staging(step, write)
        return self._finish(save, meta or {}, pre_publish, started, blocked=True)

    def publish_async(
        self,
        step: int,
        write: WriteCallback,
        *,
        meta: dict[str, Any] | None = None,
        pre_publish: Callable[[], None] | None = None,
    ) -> float:
        """As `publish`, but return once `write` has run on every rank and the staging listing agrees;
        hashing, fsync, the manifest, the rename and retention go on in a background thread.

        Returns the seconds the caller was blocked. The report (or the error) comes from the next
        `wait()`, which every later call of this publisher makes first. `pre_publish` runs in that
        thread just before the rename: a last check, not for what must be durable before the checkpoint
        appears (make that durable before calling this).
        """
        self.wait()
        started = time.monotonic()
        save = self._write_staging(step, write)
        blocked = time.monotonic() - started
        self._background = _Background(
            step, lambda: self._finish(save, meta or {}, pre_publish, started, blocked=False, blocked_s=blocked)
        )
        return blocked

    def _write_staging(self, step: int, write: WriteCallback) -> _Save:
        """Phases 1-4 (staging, shared storage, write, agreed listing); on failure the staging is removed."""
        group = self._exchange_group()
        save = _Save(group=group, step=step, context=f"checkpoint save step {step}")
        try:
            self._stage(save, write)
            return save
        except CheckpointError:
            self._remove_staging(save)
            raise

    def _finish(
        self,
        save: _Save,
        meta: dict[str, Any],
        pre_publish: Callable[[], None] | None,
        started: float,
        *,
        blocked: bool,
        blocked_s: float | None = None,
    ) -> PublishReport:
        """Phases 5-6 (hash + fsync, manifest, rename) and retention: the report, or every rank raises."""
        group = save.group
        try:
            manifest = self._hash(save, meta)
            paths = self._phase(
                save, "publish", lambda: self._install(save, manifest, pre_publish) if group.rank == 0 else None
            )
        except CheckpointError:
            self._remove_staging(save)
            raise
        published = Path(paths[0])
        removed = self._apply_retention(published) if group.rank == 0 else ()
        seconds = time.monotonic() - started
        report = PublishReport(
            path=published,
            step=save.step,
            files=len(manifest.files),
            bytes=manifest.total_bytes,
            seconds=seconds,
            removed=removed,
            blocked_s=seconds if blocked else blocked_s,
            hashed_while_written=sum(len(digests) for digests in save.known),
        )
        if group.rank == 0:
            logger.info(
                "published %s: %d files (%d hashed while written), %.1f MiB in %.2f s%s",
                published,
                report.files,
                report.hashed_while_written,
                report.bytes / 2**20,
                report.seconds,
                "" if blocked else f" (training waited {report.blocked_s:.2f} s of it)",
            )
        return report

    def _stage(self, save: _Save, write: WriteCallback) -> None:
        """Phases 1-4: a complete staging directory, its file listing (the same on every rank) and the
        digests each rank's write callback reported, into `save`."""
        group, rank = save.group, save.group.rank
        values = self._phase(save, "create-staging", lambda: self._create_staging(save))
        for other_rank, (other_step, *_ignored) in enumerate(values):
            if other_step != values[0][0]:
                raise CheckpointError(
                    f"{save.context}: ranks disagree on the step: rank 0 saves step {values[0][0]}, "
                    f"rank {other_rank} saves step {other_step}; nothing was published"
                )
        _, writer_host, staging_name, token = values[0]
        staging = save.staging = self.checkpoints_dir / staging_name
        if group.world_size > 1:
            marker = staging / MARKER_NAME
            self._phase(
                save, "shared-storage", lambda: None if rank == 0 else self._await_marker(marker, token, writer_host)
            )

        def run_write() -> dict[str, FileDigest]:
            if rank == 0 and group.world_size > 1:
                fs.remove_file(staging / MARKER_NAME)  # every rank has seen it; it must not be hashed
            known = write(staging)
            if rank == 0 and os.path.lexists(staging / MANIFEST_NAME):
                raise CheckpointError("the write callback must not create manifest.json (the publisher writes it)")
            # Anything but a mapping is no report: a lambda's incidental value (e.g. write_text's byte count).
            return dict(known) if isinstance(known, Mapping) else {}

        save.known = self._phase(save, "write", run_write)
        listing = save.listing = self._agreed_listing(save, staging)
        check_reported_digests(save.context, save.listing, save.known)
        missing = [
            part for part in self.parts if not any(path == part or path.startswith(part + "/") for path in listing)
        ]
        if missing:
            raise CheckpointError(
                f"{save.context}: the write callback produced no files for the part(s) {', '.join(missing)} "
                "this checkpoint must contain; nothing was published"
            )

    def _hash(self, save: _Save, meta: dict[str, Any]) -> Manifest:
        """Phase 5: every file fsynced and hashed (see the module docstring for who does which); the manifest."""
        rank, world_size = save.group.rank, save.group.world_size
        known_anywhere = {path for known in save.known for path in known}
        own_known = save.known[rank]
        share = list(own_known) + [path for path in save.listing if path not in known_anywhere][rank::world_size]
        digest_maps = self._phase(
            save,
            "hash",
            lambda: hash_files(
                save.staging, share, self.hash_algorithm, threads=self.hash_threads, fsync=True, known=own_known
            ),
        )
        files = {path: digest for digests in digest_maps for path, digest in digests.items()}
        return Manifest(
            step=save.step,
            parts=self.parts,
            hash_algorithm=self.hash_algorithm,
            files=files,
            world_size=save.group.world_size,
            meta=meta,
        )

    def _create_staging(self, save: _Save) -> tuple[int, str, str | None, str | None]:
        """Rank 0: make the staging dir (and the shared-storage marker). Returns (step, host, name, token)."""
        host = socket.gethostname()
        if save.group.rank != 0:
            return (save.step, host, None, None)
        if not self.checkpoints_dir.is_dir():
            os.makedirs(self.checkpoints_dir, exist_ok=True)
            fs.fsync_dir(self.checkpoints_dir.parent)
        staging = self.checkpoints_dir / staging_dir_name(save.step)
        fs.make_dir(staging)
        save.staging = staging
        token = uuid.uuid4().hex
        if save.group.world_size > 1:
            fs.write_bytes(staging / MARKER_NAME, token.encode())
        return (save.step, host, staging.name, token)

    def _await_marker(self, marker: Path, token: str, writer_host: str) -> None:
        """Non-zero ranks: wait briefly for rank 0's marker; its absence means storage is not shared."""
        deadline = time.monotonic() + min(SHARED_STORAGE_WAIT_S, self.timeout_s / 4)
        while True:
            try:
                if marker.read_bytes() == token.encode():
                    return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"checkpoint storage must be shared by all ranks: rank {self._group.rank} on host "
                    f"{socket.gethostname()} cannot see {marker}, written by rank 0 on host {writer_host}; "
                    "put output_dir on a filesystem every node mounts at the same path"
                )
            time.sleep(0.05)

    def _agreed_listing(self, save: _Save, staging: Path) -> list[str]:
        """The sorted staging file list, identical on every rank (retried briefly, then an error)."""
        for attempt in range(LISTING_ATTEMPTS):
            listings = self._phase(save, "gather-listing", lambda: list_files(staging))
            difference = describe_listing_difference(listings)
            if difference is None:
                return listings[0]
            if attempt + 1 < LISTING_ATTEMPTS:
                time.sleep(1.0)
        raise CheckpointError(
            f"{save.context}: {difference}; checkpoint storage must be shared by all ranks; nothing was published"
        )

    def _install(self, save: _Save, manifest: Manifest, pre_publish: Callable[[], None] | None) -> str:
        """Rank 0: phase 6 (`install.publish_staging`); from the publishing rename on, the staging
        directory is the checkpoint and must never be removed as a failed save's leftover."""

        def renamed() -> None:
            save.staging = None

        return str(
            publish_staging(self.checkpoints_dir, save.staging, save.step, manifest, pre_publish, renamed=renamed)
        )

    def _apply_retention(self, published: Path) -> tuple[Path, ...]:
        """Rank 0: keep_last retention; a failure is logged, never fails the save (the new checkpoint is published)."""
        if self.keep_last is None:
            return ()
        try:
            return tuple(apply_retention(self.checkpoints_dir, self.keep_last, protect=published, best=self.keep_best))
        except OSError as error:
            logger.warning("checkpoint retention failed (%s); cleanup_stale() removes leftovers at next start", error)
            return ()

    def _remove_staging(self, save: _Save) -> None:
        """Rank 0, after a failure: remove the staging directory; never raises over the original error."""
        if save.group.rank != 0 or save.staging is None or not os.path.lexists(save.staging):
            return
        try:
            fs.remove_tree(save.staging)
        except OSError as error:
            logger.warning("could not remove %s after a failed save (%s); cleanup_stale() will", save.staging, error)
