"""Ranks die with their launcher.

`deepspeed astrai/train.py` runs three generations of processes on a node:

    deepspeed (deepspeed/launcher/runner.py)      maybe under `python -m astrai launch`
      └─ python -m deepspeed.launcher.launch      one per node: starts the node's ranks, kills them on SIGINT/SIGTERM
           └─ python astrai/train.py (one per rank)

Neither launcher forwards its own death: a SIGKILLed `deepspeed` leaves `launch` waiting on the ranks,
and a SIGKILLed `launch` leaves its ranks running, training and publishing checkpoints to the end: an
orphan job nobody can stop with Ctrl-C, racing the job restarted in its place.

So a rank whose parent is DeepSpeed's per-node launcher (and only such a rank: `python astrai/train.py`
without a launcher, mpirun's and srun's ranks are untouched; their launchers clean up themselves):
- asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, Linux), which stops it at
  once, whatever it is doing;
- watches, in a daemon thread, every launcher above it (the per-node launcher, the `deepspeed` runner,
  `python -m astrai launch`) by pid and process start time (a reused pid is not its launcher), every
  WATCH_INTERVAL_S; when one is gone it logs one line, runs the registered last actions (e.g. the
  output_dir lock's release) and leaves with os._exit: no finally block, no further collective, no publish.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("astrai.launcher")

WATCH_INTERVAL_S = 1.0
ORPHAN_EXIT_CODE = 1
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
NODE_LAUNCHER_MODULE = "deepspeed.launcher.launch"
_last_actions: list[Callable[[], None]] = []
_watched: list[Launcher] | None = None


@dataclass(frozen=True)
class Launcher:
    pid: int
    start: str  # /proc/<pid>/stat start time (clock ticks since boot)
    name: str


def proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of `pid` from /proc (Linux), None when gone, a zombie (dead, not yet
    reaped by its parent: a killed `deepspeed` stays one until its shell waits for it) or unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[19]  # fields 4 and 22; the command name before ")" may hold spaces


def command_line(pid: int) -> list[str]:
    try:
        return [
            part.decode(errors="replace") for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part
        ]
    except OSError:
        return []


def launcher_name(arguments: list[str]) -> str | None:
    """Which launcher a command line is: DeepSpeed's per-node launcher, its runner, `astrai launch`; else None."""
    if NODE_LAUNCHER_MODULE in arguments:
        return "deepspeed.launcher.launch"
    names = [os.path.basename(argument) for argument in arguments[:2]]
    if "deepspeed.launcher.runner" in arguments or any(name in ("deepspeed", "ds") for name in names):
        return "deepspeed"
    for position, argument in enumerate(arguments[:-1]):
        if os.path.basename(argument) == "astrai" and arguments[position + 1] == "launch":
            return "astrai launch"
    return None


def launchers_above(pid: int | None = None) -> list[Launcher]:
    """The launchers this process descends from, nearest first: empty unless its parent is DeepSpeed's
    per-node launcher; then that one and each further ancestor that is a launcher, up to the first that is not."""
    found: list[Launcher] = []
    current = os.getpid() if pid is None else pid
    while (stat := proc_stat(current)) is not None:
        parent = stat[0]
        parent_stat = proc_stat(parent) if parent > 1 else None
        name = launcher_name(command_line(parent)) if parent_stat else None
        if name is None or (not found and name != "deepspeed.launcher.launch"):
            break
        found.append(Launcher(parent, parent_stat[1], name))
        current = parent
    return found


def at_orphan_exit(action: Callable[[], None]) -> None:
    """Run `action` (quick, never raising past here) just before an orphaned rank exits."""
    _last_actions.append(action)


def watch_launchers(interval_s: float = WATCH_INTERVAL_S) -> list[Launcher]:
    """Arm PR_SET_PDEATHSIG and start the watching thread when this rank was started by DeepSpeed's
    launcher; returns the launchers watched (empty: nothing armed)."""
    global _watched
    if _watched is not None:  # once per process
        return _watched
    launchers = _watched = launchers_above()
    if not launchers:
        return []
    _kill_me_with_my_parent()
    if proc_stat(launchers[0].pid) is None or os.getppid() != launchers[0].pid:
        _leave(launchers[0])  # the parent died before the prctl: the kernel will not tell us any more
    thread = threading.Thread(target=_watch, args=(launchers, interval_s), name="astrai-launcher-watch", daemon=True)
    thread.start()
    logger.debug(
        "watching the launchers above this rank: %s", ", ".join(f"{item.name} pid {item.pid}" for item in launchers)
    )
    return launchers


def _kill_me_with_my_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning(
                "prctl(PR_SET_PDEATHSIG) failed (errno %d): only the watching thread stops an orphaned rank",
                ctypes.get_errno(),
            )
    except (OSError, AttributeError):  # not Linux: the thread alone
        pass


def leave_if_orphaned(launchers: list[Launcher] | None = None) -> None:
    """Exit now (as the watching thread would) when a launcher above this rank is gone. Called just before a
    checkpoint's publishing rename too, so an orphan never publishes in the second between two polls."""
    for launcher in (_watched or []) if launchers is None else launchers:
        stat = proc_stat(launcher.pid)
        if stat is None or stat[1] != launcher.start:
            _leave(launcher)


def _watch(launchers: list[Launcher], interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        leave_if_orphaned(launchers)


def _leave(launcher: Launcher) -> None:
    logger.error(
        "the launcher that started this rank is gone (%s, pid %d): this rank stops now, publishing nothing more",
        launcher.name,
        launcher.pid,
    )
    for action in _last_actions:
        try:
            action()
        except Exception:  # noqa: BLE001 - leaving regardless
            pass
    os._exit(ORPHAN_EXIT_CODE)
