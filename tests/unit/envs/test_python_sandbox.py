"""astrai.envs.python: `run_python` returns what the program printed, and every way model-written code goes wrong
(an exception, a fork bomb, an endless loop, a 10 GB allocation, a write outside its directory, a network
connection, a flood of output) ends as one clean `error:` line, never an exception in the trainer, and leaves no
process behind. The `_real_boundary` tests turn the Python-level guards off to show the kernel stopping the same
code (skipped where this machine gives no namespace); the JSON schema a chat template gets is checked at the end."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import astrai.envs.python as sandbox_module
from astrai.envs.python import PythonSandbox, run_python

FAST = PythonSandbox(timeout_s=5, cpu_time_s=3)
UNGUARDED = PythonSandbox(timeout_s=5, cpu_time_s=3, python_guards=False)
BOOTSTRAP = os.path.abspath(sandbox_module.__file__)


@pytest.fixture(scope="module")
def isolation() -> dict:
    return PythonSandbox().isolation()


def _live_processes() -> list[str]:
    """Processes (not zombies) that run the sandbox's bootstrap, or are children of this test process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:  # it ended while we looked
            continue
        if state != "Z" and (BOOTSTRAP in command or int(parent) == os.getpid()):
            found.append(f"{entry.name} {state} {command[:120]}")
    return found


def _last_line(result: str) -> str:
    return result.splitlines()[-1]


def test_print_returns_stdout_then_stderr():
    assert run_python("print(6 * 7)") == "42"
    assert FAST.run("import sys\nprint('out')\nprint('err', file=sys.stderr)") == "out\nerr"
    assert FAST.run("x = 1") == "(no output)"


def test_an_exception_returns_its_last_traceback_line_and_an_error():
    result = FAST.run("total = 1\ntotal / 0")
    assert "ZeroDivisionError: division by zero" in result.splitlines()[:-1]
    assert _last_line(result) == "error: ZeroDivisionError: division by zero"
    assert 'File "<code>", line 2' in result and "total / 0" in result  # the model's own line, with its source
    assert BOOTSTRAP not in result  # none of the bootstrap's frames
    assert _last_line(FAST.run("import sys\nsys.exit(3)")) == "error: exit status 3"


def test_a_fork_bomb_ends_as_a_tool_error_and_leaves_no_process():
    started = time.monotonic()
    result = FAST.run("import os, time\nfor _ in range(6):\n    os.fork()\ntime.sleep(60)")  # at most 64 processes
    assert time.monotonic() - started < 4
    assert _last_line(result).startswith("error: BlockingIOError"), result  # RLIMIT_NPROC: the first fork fails
    assert _live_processes() == []
    assert _last_line(FAST.run("import threading\nthreading.Thread(target=print).start()")).startswith("error: ")


def test_an_infinite_loop_ends_at_the_timeout_and_keeps_what_it_printed():
    started = time.monotonic()
    result = PythonSandbox(timeout_s=1.5, cpu_time_s=30).run("print('started')\nwhile True:\n    pass")
    assert time.monotonic() - started < 4.5
    assert result == "started\nerror: timed out after 1.5 s"
    assert _live_processes() == []


def test_a_busy_loop_ends_at_the_cpu_time_limit():
    started = time.monotonic()
    result = PythonSandbox(timeout_s=20, cpu_time_s=1).run("while True:\n    pass")
    assert result == "error: CPU time limit of 1 s exceeded"
    assert time.monotonic() - started < 10


def test_a_10_gb_allocation_ends_as_a_memory_error():
    result = FAST.run("data = bytearray(10 * 1024 ** 3)")
    assert "MemoryError" in result
    assert _last_line(result) == "error: memory limit of 512 MiB exceeded"


def test_a_write_outside_its_directory_ends_as_a_tool_error(tmp_path):
    outside = tmp_path / "escape.txt"
    result = FAST.run(f"open({str(outside)!r}, 'w').write('x')")
    assert _last_line(result).startswith("error: ") and not outside.exists()
    inside = "with open('inside.txt', 'w') as file:\n    file.write('kept')\nprint(open('inside.txt').read())"
    assert FAST.run(inside) == "kept"


def test_a_write_outside_its_directory_is_refused_by_the_kernel_without_the_guards(tmp_path, isolation):
    if not isolation.get("read_only_root"):
        pytest.skip(f"no read-only root here: {isolation}")
    tmp_path.chmod(0o777)  # writable by any uid: only the read-only mount (or the hidden /tmp) is in the way
    name = f"astrai-sandbox-test-{os.getpid()}"
    for target in (str(tmp_path / "escape.txt"), f"/var/tmp/{name}", f"/dev/shm/{name}"):
        result = UNGUARDED.run(f"open({target!r}, 'w').write('x')")
        assert _last_line(result).startswith(("error: OSError", "error: FileNotFoundError")), result
        assert not Path(target).exists(), target
    # every mount is read-only in there but its working directory
    flags = "import os\nprint([os.statvfs(path).f_flag & os.ST_RDONLY for path in ('/', '/usr', '/etc', '.')])"
    assert UNGUARDED.run(flags) == "[1, 1, 1, 0]"


def test_a_network_connection_ends_as_a_tool_error():
    for sandbox in (FAST, UNGUARDED):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            result = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):  # no connection ever reached the listener
                listener.accept()
        assert _last_line(result).startswith("error: "), result


def test_the_network_namespace_refuses_without_the_guards(isolation):
    if not isolation.get("network_namespace"):
        pytest.skip(f"no network namespace here: {isolation}")
    result = UNGUARDED.run("import _socket\n_socket.socket().connect(('127.0.0.1', 22))")
    assert _last_line(result) == "error: OSError: [Errno 101] Network is unreachable"


def test_output_over_the_limit_is_truncated_and_the_program_stopped():
    started = time.monotonic()
    result = PythonSandbox(timeout_s=20, max_output_bytes=1000).run("while True:\n    print('x' * 99)")
    assert time.monotonic() - started < 4
    assert _last_line(result) == "error: output over 1000 bytes: truncated here, and the program was stopped"
    assert len(result) <= 1000 + 100
    assert _live_processes() == []


def test_the_unprivileged_path_through_a_user_namespace(isolation):
    """What a non-root trainer gets: the same limits, through a user namespace (as root: entered as nobody)."""
    unprivileged = PythonSandbox(timeout_s=5, cpu_time_s=3, python_guards=False, privileged_namespaces=False)
    got = unprivileged.isolation()
    if not got.get("user_namespace"):
        pytest.skip(f"no unprivileged user namespace here: {got}")
    assert got["network_namespace"] and got["mount_namespace"] and got["pid_namespace"], got
    assert unprivileged.run("print(sum(range(10)))") == "45"
    assert _last_line(unprivileged.run("import os\nfor _ in range(6):\n    os.fork()")).startswith("error: Blocking")
    assert _last_line(unprivileged.run("open('/var/tmp/escape', 'w')")).startswith("error: OSError")
    # its capabilities in the namespace are gone: it cannot unmount its private /tmp
    assert unprivileged.run("import ctypes\nprint(ctypes.CDLL(None).umount2(b'/tmp', 2))") == "-1"
    assert _live_processes() == []


def test_concurrent_runs_do_not_disturb_each_other():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(FAST.run, [f"print({number} * 2)" for number in range(4)]))
    assert results == ["0", "2", "4", "6"]


def test_isolation_reports_each_protection(isolation):
    assert {"network_namespace", "mount_namespace", "pid_namespace", "uid"} <= set(isolation)
    if os.geteuid() == 0:
        assert isolation["uid"] == 65534  # never root


def test_only_a_wrong_argument_raises():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(42)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        PythonSandbox(timeout_s=0)


def test_the_json_schema_a_chat_template_gets():
    from transformers.utils import get_json_schema

    function = get_json_schema(run_python)["function"]
    assert function["name"] == "run_python"
    assert function["description"].startswith("Run a Python program in a sandbox")
    parameters = function["parameters"]
    assert parameters["required"] == ["code"]
    assert parameters["properties"]["code"]["type"] == "string"
    assert "print()" in parameters["properties"]["code"]["description"]
