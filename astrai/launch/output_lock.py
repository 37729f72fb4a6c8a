"""One writer per output_dir: the lock a job's rank 0 holds on its output_dir for the whole run.

    output_dir/.astrai.lock         flock target (exclusive, non-blocking); never deleted or renamed, so
                                    two jobs can never lock two different files of the same name
    output_dir/.astrai.lock.json    the holder's record: host, pid, process start, start time, job file,
                                    rendezvous; written after the flock is taken, refreshed (mtime) every
                                    HEARTBEAT_S, removed at release

The flock is the authority where it is shared: the kernel drops it when the holder dies, however it dies
(SIGKILL included), so a dead job can never leave the output_dir locked. The record serves two more cases:
it names the running job in the refusal, and it covers filesystems whose flock is not shared between
hosts (Lustre's `localflock`, some NFS set-ups): there, a flock taken from another host proves nothing,
so a record of another host is taken for a live holder while its heartbeat is fresh (STALE_AFTER_S). A
record of this host whose pid is gone (or belongs to a newer process) is stale and taken over, logged.

Only rank 0 locks: on shared storage (which checkpoints require, docs/guides/checkpoints.md) one lock
covers every node, and a lock per node would make the ranks of one job refuse each other. astrai/train.py
takes it before anything is written into output_dir and tells every rank the outcome in the first
collective; `python -m astrai launch` refuses an output_dir whose record names a live job before it writes
its launch files. Readers (`export-hf`, `verify`, `plot`) take no lock.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from astrai.errors import AstraiError

logger = logging.getLogger("astrai.lock")

LOCK_NAME = ".astrai.lock"
RECORD_NAME = ".astrai.lock.json"
HEARTBEAT_S = 20.0
STALE_AFTER_S = 120.0  # a record of another host not refreshed for this long belongs to a dead job


class OutputDirLockedError(AstraiError, RuntimeError):
    """Another live job writes into this output_dir; the message names it (host, pid, start time)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    process_start: str | None  # /proc/<pid>/stat start time (clock ticks since boot): tells a reused pid apart
    started: str  # ISO time the lock was taken
    config: str | None  # the job file
    rendezvous: str | None  # MASTER_ADDR:MASTER_PORT of its launch: the ranks of one launch share it

    def describe(self) -> str:
        return f"host {self.host} pid {self.pid} (started {self.started}, job file {self.config or '?'})"


def process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux), None when unknown or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22; the command name before ")" may hold spaces


def process_alive(pid: int, start: str | None) -> bool:
    """Whether `pid` runs on this host and is the process that was started at `start` (when known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return start is None or process_start(pid) in (None, start)


def current_rendezvous() -> str | None:
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{address}:{port}" if address and port else None


def read_holder(output_dir: str | Path) -> tuple[Holder, float] | None:
    """The record in output_dir and its age in seconds (since its last heartbeat), or None."""
    path = Path(output_dir) / RECORD_NAME
    try:
        raw, age = path.read_bytes(), time.time() - path.stat().st_mtime
        fields = json.loads(raw)
        return Holder(**{name: fields.get(name) for name in Holder.__dataclass_fields__}), age
    except (OSError, ValueError, TypeError):  # absent, or half a record of a crashed writer: no holder named
        return None


def is_live(holder: Holder, age_s: float) -> bool:
    """From the record alone: this host's holder by its pid, another host's by its heartbeat."""
    if holder.host == socket.gethostname():
        return process_alive(int(holder.pid), holder.process_start)
    return age_s < STALE_AFTER_S


def live_holder(output_dir: str | Path, *, same_launch_ok: bool = False) -> Holder | None:
    """A live job named by output_dir's record, without taking the lock (for `launch` and for ranks other
    than 0 before the rendezvous); `same_launch_ok`: a record of this very launch (same rendezvous) is no holder."""
    found = read_holder(output_dir)
    if found is None or not is_live(*found):
        return None
    holder = found[0]
    if same_launch_ok and holder.rendezvous is not None and holder.rendezvous == current_rendezvous():
        return None
    return holder


def in_use_message(output_dir: str | Path, holder: Holder | None, age_s: float | None = None) -> str:
    where = Path(output_dir)
    if holder is None:
        return f"output_dir {where} is in use by another job (it holds {where / LOCK_NAME}; no record of it yet)"
    message = (
        f"output_dir {where} is in use by the job of {holder.describe()}: one job writes into an output_dir at a time"
    )
    if holder.host != socket.gethostname():
        message += (
            f"; if that job is gone, its record {where / RECORD_NAME} is stale {STALE_AFTER_S:g} s after its last "
            f"heartbeat ({age_s or 0:.0f} s ago), or delete it"
        )
    return message


class RunLock:
    """Rank 0's lock on output_dir: `acquire()` (OutputDirLockedError when taken), heartbeat, `release()`."""

    def __init__(self, output_dir: str | Path, config: str | None = None):
        self.output_dir = Path(output_dir)
        self.config = None if config is None else str(Path(config).resolve())
        self.descriptor: int | None = None
        self.holder: Holder | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def record_path(self) -> Path:
        return self.output_dir / RECORD_NAME

    def acquire(self) -> RunLock:
        import fcntl

        self.output_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.output_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            found = read_holder(self.output_dir)
            if found is not None and not is_live(*found):  # the holder has not yet replaced a dead job's record
                found = None
            raise OutputDirLockedError(in_use_message(self.output_dir, *(found or (None, None)))) from None
        except OSError as error:  # flock unsupported here (e.g. Lustre mounted `noflock`): the record decides alone
            if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                os.close(descriptor)
                raise
            logger.warning(
                "%s: flock is not supported on this filesystem (%s); only the holder's record guards output_dir",
                self.output_dir,
                error,
            )
        try:
            self._check_record()
            self.holder = Holder(
                socket.gethostname(),
                os.getpid(),
                process_start(os.getpid()),
                time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                self.config,
                current_rendezvous(),
            )
            self._write_record(self.holder)
        except BaseException:
            os.close(descriptor)  # drops the flock
            raise
        self.descriptor = descriptor
        self._heartbeat = threading.Thread(target=self._beat, name="astrai-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def _check_record(self) -> None:
        """The flock is ours (or unsupported); a record left behind is stale (taken over, logged) unless it
        names a live holder: another host's on storage whose flock is not shared, by its fresh heartbeat."""
        found = read_holder(self.output_dir)
        if found is None:
            return
        holder, age = found
        ours = (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
        if not ours and is_live(holder, age):
            raise OutputDirLockedError(in_use_message(self.output_dir, holder, age))
        logger.warning(
            "output_dir %s: taking over the lock of a job that is gone: %s", self.output_dir, holder.describe()
        )

    def _write_record(self, holder: Holder) -> None:
        temporary = self.record_path.with_name(f".{RECORD_NAME}.{os.getpid()}.tmp")
        with open(temporary, "w") as handle:
            json.dump(asdict(holder), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.record_path)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.record_path)
            except OSError as error:  # e.g. a full or unreachable filesystem: the run itself will say more
                logger.warning("cannot refresh %s: %s", self.record_path, error)

    def release(self) -> None:
        """Remove our record and drop the flock (the lock file stays: see the module docstring). Idempotent."""
        self._stop.set()
        if self.descriptor is None:
            return
        found = read_holder(self.output_dir)
        if (
            found is not None
            and self.holder is not None
            and (found[0].host, found[0].pid) == (self.holder.host, self.holder.pid)
        ):
            self.record_path.unlink(missing_ok=True)
        os.close(self.descriptor)
        self.descriptor = None


def describe_os_error(error: OSError, output_dir: str) -> str:
    """One line for a file system refusal: the path, the errno's name (ENOSPC, EROFS, ...) and output_dir."""
    name = errno.errorcode.get(error.errno or 0, "OSError")
    where = error.filename or output_dir
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        return f"output_dir {output_dir} is a file, not a folder ({name}: {error.strerror or error})"
    reason = error.strerror or error
    return f"{where}: {name}: {reason} (output_dir: {output_dir}; checkpoints, metrics and caches are written there)"


def lock_for_this_rank(output_dir: str | Path, config: str | None) -> tuple[RunLock, str | None]:
    """Before anything is written into output_dir, on every rank: (lock, refusal). Rank 0 (the launcher's
    RANK; 0 without one) takes the lock; its refusal is the error to raise after the rendezvous. Other
    ranks lock nothing: their refusal only says that the record names a live job of another launch, so
    that they keep their rank reports out of it until rank 0's verdict reaches them (`agree_on_lock`)."""
    lock = RunLock(output_dir, config)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        holder = live_holder(output_dir, same_launch_ok=True)
        return lock, None if holder is None else in_use_message(output_dir, holder)
    try:
        lock.acquire()
    except OutputDirLockedError as error:
        return lock, str(error)
    except OSError as error:  # e.g. an output_dir this user cannot write: every rank stops with it, none waits
        return lock, describe_os_error(error, str(output_dir))
    atexit.register(lock.release)  # also when the rendezvous raises, before the caller's try/finally
    return lock, None


def agree_on_lock(refusal: str | None, gather) -> None:
    """Every rank learns rank 0's outcome in one collective (`gather`: astrai.engine.all_gather_objects) and
    raises the same OutputDirLockedError, so no rank goes on alone or waits for a rank 0 that has stopped."""
    verdict = gather(refusal)[0]
    if verdict is not None:
        raise OutputDirLockedError(verdict)
