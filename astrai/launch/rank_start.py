"""One rank's start-up and shut-down, the same for both programs a launcher starts on every rank:
astrai/train.py (then trains) and astrai/launch/preflight.py (reports, checks, exits).

    start = RankStart(job, config_path)
    if (code := start.open()) is not None:    # environment, log format, lock, first report, rendezvous
        return code
    try:
        start.agree_on_lock()                 # every rank stops together when output_dir is taken
        start.preflight()                     # one gather of every rank's report: versions, devices
        ...                                   # the program's own work
    finally:
        start.close()                         # process group down, lock released

The launcher watch comes first (`watch_launchers`, before the job is read), so a rank of a launcher that
dies while the job loads stops too. The order inside `open` is the contract of the rank report: it is
written before the rendezvous, so it exists even if that hangs (astrai/launch/preflight.py).
"""

from __future__ import annotations

import logging
import os
import sys

from astrai.launch.environment import apply_environment, prepare_rank_environment
from astrai.launch.launcher_watch import at_orphan_exit
from astrai.launch.output_lock import agree_on_lock, describe_os_error, lock_for_this_rank
from astrai.launch.preflight import preflight_check, write_rank_report

logger = logging.getLogger("astrai")


class RankStart:
    """A rank between its launch and its exit: the job's environment, the output_dir lock, the rank report,
    the process group. `log_level` None: ASTR_LOG_LEVEL (the shell's or the job's environment, applied first),
    else `runtime.log_level`. `prog` prefixes the one-line errors printed before logging is set up."""

    def __init__(self, job, config_path: str, log_level: str | None = None, prog: str = "astrai"):
        self.job, self.config_path, self.log_level, self.prog = job, config_path, log_level, prog
        self.lock = None
        self.refusal: str | None = None
        self.dist = None

    def open(self) -> int | None:
        """Everything before the first collective; None when the rank is started, else the exit code (1)."""
        from astrai.engine import set_log_format, setup_distributed
        from astrai.engine.distributed import RendezvousError

        job = self.job
        apply_environment(job.runtime.environment)
        prepare_rank_environment()  # ranks started by mpirun/srun get torch's RANK, WORLD_SIZE, LOCAL_RANK
        # Before the rendezvous (the launcher's RANK names the rank), so what setup logs (threads per rank) shows.
        level = self.log_level or os.environ.get("ASTR_LOG_LEVEL") or job.runtime.log_level
        set_log_format(int(os.environ.get("RANK", "0")), level)
        self.lock, self.refusal = lock_for_this_rank(job.output_dir, self.config_path)  # before any write there
        at_orphan_exit(self.lock.release)
        if self.refusal is None:
            try:
                write_rank_report(job)  # written before the rendezvous, so it exists even if that hangs
            except OSError as error:  # the first write into output_dir: a file there, read-only, full
                print(f"{self.prog}: {describe_os_error(error, job.output_dir)}", file=sys.stderr)
                return 1
        try:
            self.dist = setup_distributed(job.runtime.dist_timeout_s)
        except RendezvousError as error:
            logger.error("%s", error)
            return 1
        return None

    def agree_on_lock(self) -> None:
        """Rank 0's verdict on the output_dir lock reaches every rank in one collective (OutputDirLockedError)."""
        from astrai.engine import all_gather_objects

        agree_on_lock(self.refusal, all_gather_objects)

    def preflight(self) -> dict:
        """The report again, now with the rank's place in the group, and one gather comparing every rank's
        (PreflightError on all ranks at once); returns the summary."""
        return preflight_check(self.job, self.dist, write_rank_report(self.job, self.dist))

    def close(self) -> None:
        from astrai.engine import shutdown_distributed

        shutdown_distributed()
        if self.lock is not None:
            self.lock.release()
