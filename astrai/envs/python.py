"""`run_python`: a tool that runs model-written Python in a sandboxed child process.

Each call starts a fresh `python -I -S -u` (standard library only; environment: PATH and LANG) that runs this file
as its bootstrap: it reads the code from stdin, closes stdin, isolates itself, sets its limits and runs the code,
all in its own fresh, single-threaded interpreter (no `preexec_fn`, which is unsafe in the threaded trainer).

What it protects against (kernel-enforced unless it says otherwise):
- Runaway code: a wall-clock timeout kills the whole process group (and, in a PID namespace, the namespace);
  RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space), RLIMIT_FSIZE (the largest file it may write), no core
  files, and stdout + stderr cut at a byte limit (the program is stopped there).
- Fork bombs: RLIMIT_NPROC counts every process and thread of the uid the code runs as (per user namespace where
  one is made). The default, 1, makes any fork or new thread fail at once. Caveat: without a user namespace, as
  the trainer's own uid, the count includes the trainer's processes (a value above 1 means little there); and the
  kernel does not apply RLIMIT_NPROC to root, which is why a root trainer's sandbox runs as `sandbox_uid`.
- The network, where the OS allows a network namespace (as root, or through an unprivileged user namespace): the
  code sees only a loopback that is down, so no connection leaves, not even to 127.0.0.1.
- Writes outside its directory, where a mount namespace can be made: the whole file system is read-only to it,
  /tmp is a fresh size-limited tmpfs that is its working directory (the host's /tmp is hidden), /var/tmp and
  /dev/shm are empty and read-only. Otherwise it runs in an empty temporary directory, removed afterwards.
- The trainer's processes, where a PID namespace can be made: the code sees only its own processes (a fresh
  /proc), so it cannot signal, trace or read the environment of the trainer, and all it started dies with it. A
  root trainer's sandbox runs as `sandbox_uid` (nobody), never as root; capabilities are dropped and
  `no_new_privs` is set, so no setuid program raises its privileges.
`PythonSandbox().isolation()` reports which of these this machine gave; a missing namespace is logged once.

Best-effort only, NOT a security boundary: the Python-level guards (`python_guards`): `socket.socket` refuses,
`open` / `io.open` / `os.open` refuse writing outside the working directory. They make the common cases fail
cleanly where no namespace exists, but code gets around them at will (`_socket`, `ctypes`, `posix`, ...).

What it does NOT protect against: it shares the host's kernel (a kernel bug is an escape) and there is no
seccomp filter, so every system call is open (nested user namespaces included, with their kernel surface). It
reads whatever its uid can read: model weights, configs, any secret in a readable file (without a mount namespace
also /tmp; as the trainer's uid, the trainer's own files), and it may connect to a Unix socket in the file system
that its uid may write. Without namespaces and run as the trainer's uid, it can signal and trace the trainer's
processes and read their environment. No cgroup caps its CPU share or total memory across sandboxes (tmpfs pages
are not in RLIMIT_AS). Namespaces are Linux only. Hostile code from outside wants a VM or gVisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import pathlib
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger(__name__)

# Linux flags (uapi headers): unshare(2), mount(2), mount_setattr(2), prctl(2)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_FDCWD, AT_RECURSIVE, SYS_MOUNT_SETATTR = 1, 2, -100, 0x8000, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
CHILD_ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_warned_about_isolation = False


@dataclasses.dataclass(frozen=True)
class PythonSandbox:
    """The limits of one sandboxed run; `run(code)` runs a program under them and returns what the model sees."""

    timeout_s: float = 10.0  # wall clock; the whole process group is killed past it
    cpu_time_s: int = 5  # RLIMIT_CPU, CPU seconds
    memory_mb: int = 512  # RLIMIT_AS, MiB of address space (the interpreter itself takes ~30)
    file_size_mb: int = 16  # RLIMIT_FSIZE, MiB: the largest file it may write
    disk_mb: int = 32  # size of the private /tmp (its working directory) where a mount namespace exists
    max_processes: int = 1  # RLIMIT_NPROC of the uid it runs as: 1 lets it start no process or thread
    max_output_bytes: int = 8000  # stdout + stderr; the program is stopped past it and the output truncated
    python_guards: bool = True  # best-effort socket / write-outside guards in the child (not a boundary)
    sandbox_uid: int = 65534  # the uid and gid it runs as when the trainer is root (nobody / nogroup)
    sandbox_gid: int = 65534
    privileged_namespaces: bool = True  # as root, make namespaces directly (else as sandbox_uid, in a user one)

    def __post_init__(self):
        for name in (field.name for field in dataclasses.fields(self) if field.type in ("int", "float")):
            if not getattr(self, name) > 0:
                raise ValueError(f"PythonSandbox.{name} must be positive, got {getattr(self, name)!r}")

    def run(self, code: str) -> str:
        """Run `code`; return its stdout, then its stderr, then one `error: ...` line if it failed or was stopped.
        Every failure of the program is in the text; only a wrong argument (code not a string) raises."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        try:
            outcome = self._execute(code)
        except OSError as error:  # no fork, no temp dir: the host's fault, told to the model as a tool error
            return f"error: the sandbox could not start: {error}"
        _warn_once_if_degraded(outcome.status)
        return self._render(outcome)

    def isolation(self) -> dict[str, bool | int]:
        """What this machine gives it (namespaces, read-only root, private /tmp and /proc, uid): runs `pass`."""
        return self._execute("pass").status

    def _execute(self, code: str) -> _Outcome:
        config = dataclasses.asdict(self)
        with tempfile.TemporaryDirectory(prefix="astrai-python-", ignore_cleanup_errors=True) as workdir:
            status_read, config["status_fd"] = os.pipe()  # the child reports its isolation there
            command = [sys.executable, "-I", "-S", "-u", os.path.abspath(__file__), json.dumps(config)]
            try:
                if os.geteuid() == 0:
                    os.chown(workdir, self.sandbox_uid, self.sandbox_gid)
                pipe = subprocess.PIPE
                process = subprocess.Popen(
                    command,
                    **dict(stdin=pipe, stdout=pipe, stderr=pipe, cwd=workdir, env=CHILD_ENVIRONMENT),
                    start_new_session=True,  # its own process group, killed as one
                    pass_fds=(config["status_fd"],),
                )
            except BaseException:
                os.close(status_read)
                raise
            finally:
                os.close(config["status_fd"])
            try:
                outcome = self._communicate(process, code.encode("utf-8", "surrogatepass"))
            finally:
                _kill_group(process)
                process.wait()
                status = _read_status(status_read)
        outcome.returncode, outcome.status = process.returncode, status
        return outcome

    def _communicate(self, process: subprocess.Popen, code: bytes) -> _Outcome:
        """Feed the code to stdin, collect stdout and stderr up to the limit, stop at the deadline."""
        outcome, pending = _Outcome(), memoryview(code)
        deadline = time.monotonic() + self.timeout_s
        with selectors.DefaultSelector() as selector:
            for stream in (process.stdout, process.stderr, process.stdin):
                os.set_blocking(stream.fileno(), False)
            selector.register(process.stdout, selectors.EVENT_READ, outcome.stdout)
            selector.register(process.stderr, selectors.EVENT_READ, outcome.stderr)
            selector.register(process.stdin, selectors.EVENT_WRITE)
            readers = selector.get_map()  # a live view: stdout and stderr leave it at their EOF
            while (process.stdout in readers or process.stderr in readers) and not outcome.truncated:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    outcome.timed_out = True
                    break
                for key, _ in selector.select(remaining):
                    if key.fileobj is process.stdin:
                        pending = _feed(selector, process.stdin, pending)
                    elif data := os.read(key.fd, 65536):
                        key.data.extend(data)
                        outcome.truncated |= len(outcome.stdout) + len(outcome.stderr) > self.max_output_bytes
                    else:
                        selector.unregister(key.fileobj)
            if not process.stdin.closed:  # the child ended before reading all of it
                _feed(selector, process.stdin, pending[:0])
            try:  # at EOF it may still run, having closed its stdout and stderr
                if not (outcome.timed_out or outcome.truncated):
                    process.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                outcome.timed_out = True
            if outcome.timed_out or outcome.truncated:
                _kill_group(process)
                _drain(selector, time.monotonic() + 2.0)  # EOF on both pipes: every holder has exited
        return outcome

    def _render(self, outcome: _Outcome) -> str:
        stdout, stderr = bytes(outcome.stdout), bytes(outcome.stderr)
        if outcome.truncated:
            stdout = stdout[: self.max_output_bytes]
            stderr = stderr[: self.max_output_bytes - len(stdout)]
        texts = [data.decode("utf-8", "replace").rstrip("\n") for data in (stdout, stderr)]
        parts = [text for text in texts + [self._error_line(outcome, texts[1])] if text]
        return "\n".join(parts) if parts else "(no output)"

    def _error_line(self, outcome: _Outcome, stderr: str) -> str | None:
        code = outcome.returncode
        last_line = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
        if outcome.truncated:
            return f"error: output over {self.max_output_bytes} bytes: truncated here, and the program was stopped"
        if outcome.timed_out:
            return f"error: timed out after {self.timeout_s:g} s"
        if code == -signal.SIGXCPU:
            return f"error: CPU time limit of {self.cpu_time_s} s exceeded"
        if code == 1 and last_line.startswith("MemoryError"):
            return f"error: memory limit of {self.memory_mb} MiB exceeded"
        if code == 0:
            return None
        if not outcome.status:
            return f"error: the sandbox failed to start (exit status {code})"
        if code < 0:
            return f"error: killed by {signal.Signals(-code).name}"
        if code == 1 and last_line and not last_line.startswith(" "):
            return f"error: {last_line}"  # the exception the traceback above ends with
        return f"error: exit status {code}"


@dataclasses.dataclass
class _Outcome:
    stdout: bytearray = dataclasses.field(default_factory=bytearray)
    stderr: bytearray = dataclasses.field(default_factory=bytearray)
    returncode: int = 0
    timed_out: bool = False
    truncated: bool = False
    status: dict = dataclasses.field(default_factory=dict)


DEFAULT_SANDBOX = PythonSandbox()


def run_python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Each call is a fresh program with only the standard library, no network, no input, an empty working
    directory and limits on time and memory; nothing is kept between calls. The result is its stdout, then its
    stderr, then a line starting with "error:" if it failed or was stopped.

    Args:
        code: The complete Python program to run. Use print() for every value you want to see.
    """
    return DEFAULT_SANDBOX.run(code)


# ----------------------------------------------------------------------------- parent-side helpers


def _feed(selector: selectors.BaseSelector, stdin, pending: memoryview) -> memoryview:
    """Write the next chunk of the code to the child's stdin; close it once all is written (or the child is gone)."""
    with contextlib.suppress(BlockingIOError):
        try:
            pending = pending[os.write(stdin.fileno(), pending[:65536]) :] if pending else pending
        except BrokenPipeError:  # it ended without reading all of it
            pending = pending[:0]
        if not pending:
            selector.unregister(stdin)
            with contextlib.suppress(OSError):
                stdin.close()
    return pending


def _drain(selector: selectors.BaseSelector, deadline: float) -> None:
    """Discard what the (killed) child still writes until both pipes reach EOF or the deadline passes."""
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(max(deadline - time.monotonic(), 0)):
            if not os.read(key.fd, 65536):
                selector.unregister(key.fileobj)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's process group (before it is reaped, so the group id cannot have been reused)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _read_status(fd: int) -> dict:
    """The isolation the child reported (written just before the code ran); {} if it never got there."""
    os.set_blocking(fd, False)
    try:
        return json.loads(os.read(fd, 65536) or b"{}")
    except (BlockingIOError, ValueError):
        return {}
    finally:
        os.close(fd)


def _warn_once_if_degraded(status: dict) -> None:
    global _warned_about_isolation
    missing = [name for name in ("network_namespace", "mount_namespace", "pid_namespace") if not status.get(name)]
    if status and missing and not _warned_about_isolation:
        _warned_about_isolation = True
        logger.warning(
            "run_python: this host gave the sandbox no %s (user namespaces disabled, or a container without "
            "CAP_SYS_ADMIN): it has its rlimits and best-effort Python guards only (see astrai/envs/python.py)",
            " / ".join(missing),
        )


# ----------------------------------------------------------------------------- the child (this file as __main__)


class MountAttr(ctypes.Structure):  # struct mount_attr of mount_setattr(2)
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _child_main(config: dict) -> None:
    import resource

    code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin closed: a read gets EOF
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status = _isolate(config) if sys.platform.startswith("linux") else {}
    status["uid"] = os.getuid()
    _set_limits(config)
    os.write(config["status_fd"], json.dumps(status).encode())
    os.close(config["status_fd"])
    if config["python_guards"]:
        _install_guards(os.getcwd())
    _run_code(code)


def _isolate(config: dict) -> dict:
    """Namespaces, mounts, the uid and capabilities; returns what it got. With a PID namespace this process
    forks: the child (pid 1 there) returns and runs the code, this one waits and ends as it does."""
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    if root:
        _keep_the_standard_library_reachable()
    privileged = root and config["privileged_namespaces"]
    flags = _unshare(libc, [CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNET]) if privileged else 0
    if not flags:  # unprivileged: a user namespace, entered as the uid the code will run as
        if root:
            _drop_privileges(libc, config)
        every = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
        flags = _unshare(libc, [every, CLONE_NEWUSER | CLONE_NEWNET])
        if flags & CLONE_NEWUSER:
            _map_own_ids()
    kinds = {"user": CLONE_NEWUSER, "network": CLONE_NEWNET, "mount": CLONE_NEWNS, "pid": CLONE_NEWPID}
    status = {f"{kind}_namespace": bool(flags & flag) for kind, flag in kinds.items()}
    if flags & CLONE_NEWNS:  # the private /tmp belongs to the uid the code will run as
        owner = (config["sandbox_uid"], config["sandbox_gid"]) if os.geteuid() == 0 else (os.getuid(), os.getgid())
        status.update(_private_filesystem(libc, config["disk_mb"], owner))
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if flags & CLONE_NEWPID:
        if child := os.fork():
            os.close(config["status_fd"])
            _relay(child, config["cpu_time_s"])
        status["private_proc"] = bool(flags & CLONE_NEWNS) and _private_proc(libc)
    if os.geteuid() == 0:
        _drop_privileges(libc, config)
    elif flags & CLONE_NEWUSER:
        _drop_capabilities(libc)
    if flags & CLONE_NEWPID:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the uid change, which clears it
    return status


def _unshare(libc, attempts: list[int]) -> int:
    """The first set of namespace flags unshare(2) accepts, or 0."""
    return next((flags for flags in attempts if libc.unshare(flags) == 0), 0)


def _drop_privileges(libc, config: dict) -> None:
    """Root becomes `sandbox_uid` (every capability goes with it). Dumpable again, as setuid left /proc/self to
    root: the uid map and /proc/self/fd (see below) need it."""
    os.setgroups([])
    os.setresgid(config["sandbox_gid"], config["sandbox_gid"], config["sandbox_gid"])
    os.setresuid(config["sandbox_uid"], config["sandbox_uid"], config["sandbox_uid"])
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def _keep_the_standard_library_reachable() -> None:
    """An interpreter installed where `sandbox_uid` cannot go (pyenv under /root, mode 700) would lose its standard
    library at the uid drop: such sys.path folders are opened now and imported through /proc/self/fd."""
    moved = {}
    for index, entry in enumerate(sys.path):
        if os.path.isdir(entry) and not _open_to_others(entry):
            moved[entry] = sys.path[index] = f"/proc/self/fd/{os.open(entry, os.O_PATH | os.O_DIRECTORY)}"
    for module in list(sys.modules.values()):  # packages imported already (encodings) find submodules there too
        path = getattr(module, "__path__", None)
        for old, new in moved.items() if isinstance(path, list) else ():
            path[:] = [new + entry[len(old) :] if entry.startswith(old + os.sep) else entry for entry in path]
    sys.path_importer_cache.clear()


def _open_to_others(folder: str) -> bool:
    """Whether a uid that is neither owner nor group may list `folder` and pass through every folder above it."""
    path = pathlib.Path(folder).resolve()
    return bool(path.stat().st_mode & stat.S_IROTH) and all(up.stat().st_mode & stat.S_IXOTH for up in path.parents)


def _map_own_ids() -> None:
    """Map our uid and gid onto themselves in the new user namespace (RLIMIT_NPROC keeps counting that uid)."""
    uid, gid = os.getuid(), os.getgid()
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)


def _mount(libc, source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> bool:
    source, target, kind, data = (None if text is None else text.encode() for text in (source, target, kind, data))
    return libc.mount(source, target, kind, ctypes.c_ulong(flags), data) == 0


def _private_filesystem(libc, disk_mb: int, owner: tuple[int, int]) -> dict[str, bool]:
    """In the new mount namespace: everything read-only, a fresh tmpfs on /tmp as the working directory, empty
    read-only /var/tmp and /dev/shm."""

    def set_root_attributes(attr: MountAttr) -> bool:
        arguments = (ctypes.c_int(AT_FDCWD), b"/", ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr))
        return libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), *arguments, ctypes.c_size_t(ctypes.sizeof(attr))) == 0

    if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):  # nothing of ours propagates to the host
        return {"read_only_root": False, "private_tmp": False}
    read_only = set_root_attributes(MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID))
    tmp_options = f"size={disk_mb}m,mode=0700,uid={owner[0]},gid={owner[1]}"
    private_tmp = _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options)
    if private_tmp:
        os.chdir("/tmp")
    elif read_only:  # no writable directory would be left: give the read-only root up instead
        read_only = not set_root_attributes(MountAttr(attr_clr=MOUNT_ATTR_RDONLY))
    for path in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    return {"read_only_root": read_only, "private_tmp": private_tmp}


def _private_proc(libc) -> bool:
    """A /proc that shows only this PID namespace; failing that, an empty one (unless imports go through it)."""
    if _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC):
        return True
    hide = not any(entry.startswith("/proc/") for entry in sys.path)
    return hide and _mount(libc, "tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")


def _drop_capabilities(libc) -> None:
    """Empty every capability set: a user namespace's owner holds all of them there, and could undo the mounts."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # 2 x (effective, permitted, inheritable), all empty
        raise OSError(ctypes.get_errno(), "capset failed: the sandbox will not run with capabilities")


def _relay(child: int, cpu_time_s: int) -> None:
    """Wait for the namespace's pid 1 and end as it did. Pid 1 ignores SIGXCPU, so it dies by the hard CPU limit's
    SIGKILL a second later: its CPU time tells which, and the parent sees SIGXCPU for a CPU-limit death."""
    _, wait_status, usage = os.wait4(child, 0)
    if os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        if number == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_time_s:  # past the soft limit
            number = signal.SIGXCPU
        if number != signal.SIGKILL:
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(wait_status))


def _set_limits(config: dict) -> None:
    import resource

    mebibyte = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_time_s"], config["cpu_time_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_mb"] * mebibyte,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["file_size_mb"] * mebibyte,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (config["max_processes"],) * 2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit raises OSError (EFBIG)


def _install_guards(root: str) -> None:
    """Best-effort, NOT a security boundary: no sockets, no writing outside `root`, at the Python level."""
    import builtins
    import errno
    import io
    import socket

    class RefusedSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "network access is disabled in this sandbox")

    def check(path, writes: bool) -> None:
        if writes and not isinstance(path, int):
            full = os.path.realpath(os.fsdecode(os.fspath(path)))
            if full != root and not full.startswith(root.rstrip("/") + "/"):
                raise PermissionError(errno.EACCES, "writing outside the working directory is not allowed", path)

    def guarded_open(file, mode="r", *args, _open=builtins.open, **kwargs):
        check(file, any(letter in mode for letter in "wax+"))
        return _open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None, _open=os.open):
        check(path, dir_fd is None and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)))
        return _open(path, flags, mode, dir_fd=dir_fd)

    socket.socket = socket.SocketType = RefusedSocket
    builtins.open = io.open = guarded_open
    os.open = guarded_os_open


def _run_code(code: str) -> None:
    """Run the code as __main__; an exception prints its traceback (without this file's frames) and exits 1."""
    import builtins
    import linecache
    import traceback

    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
    sys.argv = ["<code>"]
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit:
        raise
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
