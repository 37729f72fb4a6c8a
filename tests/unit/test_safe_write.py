"""astrai/safe_write.py on the real filesystem: a crash between any two steps leaves the old content
or the new, never a mix; nothing temporary outlives a failure.

A crash is simulated by making one step raise (os.replace, os.rename, os.fsync) after the steps
before it have really run, then reading what a restarted process would find on disk."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from astrai import safe_write
from astrai.safe_write import install_folder, write_file_atomic


def leftovers(folder) -> list[str]:
    """Hidden names (temporary files, staging or retired folders) left in `folder`."""
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


def tree(folder) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(folder)
        for name in names
    }


class Crash(Exception):
    pass


def crash_on(monkeypatch, module, name, when=lambda *args: True):
    """Make `module.name` raise Crash when `when(*args)`; the call goes through otherwise."""
    real = getattr(module, name)

    def failing(*args, **kwargs):
        if when(*args):
            raise Crash(f"{name} crashed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


# ----------------------------------------------------------------------------- one file


def test_write_file_atomic_creates_and_replaces_text_and_bytes(tmp_path):
    path = tmp_path / "hostfile"
    write_file_atomic(path, "node-1 slots=2\n")
    assert path.read_text() == "node-1 slots=2\n"
    write_file_atomic(path, b"\x00binary")
    assert path.read_bytes() == b"\x00binary" and leftovers(tmp_path) == []


def test_a_non_durable_write_replaces_atomically_without_any_fsync(tmp_path, monkeypatch):
    """durable=False (trackers.json, rewritten every step): same rename discipline, no fsync at all."""
    target = tmp_path / "state.json"
    write_file_atomic(target, "old")
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    write_file_atomic(target, "new", durable=False)
    assert target.read_text() == "new" and synced == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_file_atomic(target, "newer")
    assert target.read_text() == "newer" and len(synced) == 2  # the file, then its folder


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_crash_before_the_replace_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch, step):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    crash_on(monkeypatch, os, step)  # fsync: the temporary is written, not yet durable; replace: durable, not in place
    with pytest.raises(Crash):
        write_file_atomic(path, '{"step": 1}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert leftovers(tmp_path) == []


def test_a_crash_after_the_replace_leaves_the_whole_new_file(tmp_path, monkeypatch):
    path = tmp_path / "rank_0.json"
    path.write_text("old")
    crash_on(monkeypatch, safe_write, "fsync_path")  # the directory fsync, the last step
    with pytest.raises(Crash):
        write_file_atomic(path, "new content")
    monkeypatch.undo()
    assert path.read_text() == "new content" and leftovers(tmp_path) == []


def test_a_killed_writer_leaves_old_or_new_never_a_mix(tmp_path):
    """A real SIGKILL at the replace: only the old file (under its name) and the temporary, never a half file."""
    path = tmp_path / "env"
    path.write_text("OLD=1\n")
    script = (
        "import os, signal, sys; from astrai.safe_write import write_file_atomic\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"write_file_atomic({str(path)!r}, 'NEW=2\\n' * 1000)\n"
    )
    from tests.conftest import REPO, child_env

    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, timeout=120)
    assert result.returncode == -9
    assert path.read_text() == "OLD=1\n"
    (temporary,) = leftovers(tmp_path)  # a kill -9 cannot clean up; the temporary is hidden and whole
    assert (tmp_path / temporary).read_text() == "NEW=2\n" * 1000


# ----------------------------------------------------------------------------- one folder


def fill(content: dict[str, str]):
    def write(staging):
        for name, text in content.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)

    return write


OLD = {"config.json": "old", "sub/weights.bin": "old weights"}
NEW = {"config.json": "new", "tokenizer.json": "new tokenizer"}


def test_install_folder_creates_and_replaces(tmp_path):
    destination = tmp_path / "out" / "tokenizer"
    install_folder(destination, fill(OLD))
    assert tree(destination) == {"config.json": b"old", "sub/weights.bin": b"old weights"}
    install_folder(destination, fill(NEW))
    assert tree(destination) == {"config.json": b"new", "tokenizer.json": b"new tokenizer"}
    assert leftovers(tmp_path / "out") == []


def test_install_folder_replaces_an_empty_folder(tmp_path):
    destination = tmp_path / "hf"
    destination.mkdir()
    install_folder(destination, fill(NEW))
    assert set(tree(destination)) == {"config.json", "tokenizer.json"} and leftovers(tmp_path) == []


@pytest.mark.parametrize("step", ["write", "fsync", "retire", "rename"])
def test_a_crash_before_the_swap_keeps_the_old_folder_whole(tmp_path, monkeypatch, step):
    destination = tmp_path / "hf"
    install_folder(destination, fill(OLD))
    before = tree(destination)
    if step == "write":
        write = fill(NEW)

        def half_then_crash(staging):
            write(staging)
            raise Crash("disk full")

        writer = half_then_crash
    else:
        writer = fill(NEW)
        if step == "fsync":
            crash_on(monkeypatch, os, "fsync")
        elif step == "retire":  # the first rename: the old folder aside
            crash_on(monkeypatch, os, "rename", lambda source, _: source == destination)
        else:  # the second rename fails: the old folder is put back
            crash_on(monkeypatch, os, "rename", lambda source, _: ".staging-" in str(source))
    with pytest.raises(Crash):
        install_folder(destination, writer)
    monkeypatch.undo()
    assert tree(destination) == before and leftovers(tmp_path) == []


def test_a_crash_after_the_swap_leaves_the_whole_new_folder(tmp_path, monkeypatch):
    destination = tmp_path / "hf"
    install_folder(destination, fill(OLD))
    crash_on(monkeypatch, safe_write, "fsync_path", lambda path: path == tmp_path)  # the parent's fsync
    with pytest.raises(Crash):
        install_folder(destination, fill(NEW))
    monkeypatch.undo()
    assert tree(destination) == {"config.json": b"new", "tokenizer.json": b"new tokenizer"}
    assert all(".retired-" in name for name in leftovers(tmp_path))  # only the replaced copy, whole, hidden


def test_stale_staging_lists_only_this_destinations_staging(tmp_path):
    (tmp_path / ".hf.staging-0123").mkdir()
    (tmp_path / ".hf2.staging-0123").mkdir()
    assert safe_write.stale_staging(tmp_path / "hf") == [tmp_path / ".hf.staging-0123"]
