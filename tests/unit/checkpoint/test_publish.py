"""CheckpointPublisher in one process: real files in tmp_path, faults injected through astrai.checkpoint.fs."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest

from astrai.checkpoint import (
    CheckpointError,
    CheckpointPublisher,
    StreamedFiles,
    cleanup_stale,
    find_latest,
    fs,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
)
from astrai.checkpoint.layout import list_hidden
from astrai.checkpoint.manifest import MANIFEST_NAME


class SimulatedCrash(BaseException):
    """Raised by a wrapper to stand for a crash: BaseException, so no cleanup code catches it."""


class FsRecorder:
    """Wraps every function of astrai.checkpoint.fs: records (name, *str(args)), optionally raises."""

    NAMES = ("write_bytes", "fsync_file", "fsync_dir", "rename", "make_dir", "remove_file", "remove_tree")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[str, ...]] = []
        self.faults: dict = {}  # name -> function(*args) returning an exception to raise, or None
        for name in self.NAMES:
            monkeypatch.setattr(fs, name, self._wrap(name, getattr(fs, name)))

    def _wrap(self, name, original):
        def wrapper(*args):
            self.calls.append((name, *(str(argument) for argument in args)))
            fault = self.faults.get(name)
            problem = fault(*args) if fault else None
            if problem is not None:
                raise problem
            return original(*args)

        return wrapper

    def index(self, name: str, *args: str) -> int:
        """Position of the first call `name(*args)`; fails the test when absent."""
        wanted = (name, *(str(argument) for argument in args))
        return self.calls.index(wanted)


@pytest.fixture
def recorder(monkeypatch):
    return FsRecorder(monkeypatch)


def payload_writer(tag: str = "a", calls: list | None = None):
    """A write callback producing policy/ shards, trainer_state.json and job.yaml whose bytes depend on `tag`."""

    def write(staging: Path) -> None:
        if calls is not None:
            calls.append(staging)
        (staging / "policy" / "zero").mkdir(parents=True)
        (staging / "policy" / "mp_rank_00_model_states.pt").write_bytes(f"model-{tag}".encode() * 1000)
        (staging / "policy" / "zero" / "optim_states.pt").write_bytes(f"optim-{tag}".encode() * 3000)
        (staging / "trainer_state.json").write_text(json.dumps({"tag": tag}))
        (staging / "job.yaml").write_text(f"tag: {tag}\n")

    return write


def published_names(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if not path.name.startswith("."))


def hidden_names(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.name.startswith("."))


def test_publish_then_verify_roundtrip(tmp_path):
    publisher = CheckpointPublisher(tmp_path / "checkpoints", parts=["policy"])
    report = publisher.publish(500, payload_writer(), meta={"run": "unit"})

    assert report.path == tmp_path / "checkpoints" / "step_00000500" and report.files == 4
    document = json.loads((report.path / MANIFEST_NAME).read_text())
    assert document["format"] == "astrai-checkpoint" and document["version"] == 1 and document["step"] == 500
    assert document["parts"] == ["policy"] and document["hash"] == "sha256" and document["world_size"] == 1
    assert document["meta"] == {"run": "unit"} and "created" in document
    assert list(document["files"]) == sorted(document["files"]) and MANIFEST_NAME not in document["files"]
    assert document["files"]["policy/zero/optim_states.pt"]["size"] == len(b"optim-a") * 3000
    verified = verify_checkpoint(report.path)
    assert (verified.files, verified.bytes, verified.step) == (4, report.bytes, 500)
    assert hidden_names(tmp_path / "checkpoints") == []
    assert find_latest(tmp_path / "checkpoints") == report.path


def test_single_process_makes_no_distributed_calls(tmp_path, monkeypatch):
    import torch.distributed as distributed

    def forbidden(*args, **kwargs):
        raise AssertionError("a single process must not call torch.distributed")

    for name in ("new_group", "all_gather_object", "broadcast_object_list", "barrier", "monitored_barrier"):
        monkeypatch.setattr(distributed, name, forbidden)
    assert not distributed.is_initialized()
    report = CheckpointPublisher(tmp_path).publish(1, payload_writer())
    verify_checkpoint(report.path)


@pytest.mark.parametrize("algorithm, digest_length", [("sha256", 64), ("blake2b", 128), ("xxh3_128", 32)])
def test_hash_algorithms(tmp_path, algorithm, digest_length):
    report = CheckpointPublisher(tmp_path, hash_algorithm=algorithm).publish(3, payload_writer())
    manifest = read_manifest(report.path)
    assert manifest.hash_algorithm == algorithm
    assert {len(entry.digest) for entry in manifest.files.values()} == {digest_length}
    assert verify_checkpoint(report.path).algorithm == algorithm


def test_the_job_default_hash_is_sha256_and_is_recorded(tmp_path):
    """The contract (issue 3): a job that names no `checkpoint.hash` publishes sha256 digests, named in
    the manifest; xxh3_128 stays a choice. Digests are checked against hashlib, not only their length."""
    import hashlib

    from astrai.config import load_job
    from astrai.config.schema import CheckpointConfig
    from tests.integration.plan import write_job

    assert CheckpointConfig().hash == "sha256"
    job = load_job(write_job(tmp_path, "tiny"), [])  # a job file without a checkpoint section
    assert job.checkpoint.hash == "sha256"
    assert load_job(write_job(tmp_path, "fast"), ["checkpoint.hash=xxh3_128"]).checkpoint.hash == "xxh3_128"

    report = CheckpointPublisher(tmp_path / "checkpoints", hash_algorithm=job.checkpoint.hash).publish(
        1, payload_writer()
    )
    document = json.loads((report.path / MANIFEST_NAME).read_text())
    assert document["hash"] == "sha256"
    for relative, entry in document["files"].items():
        assert entry["digest"] == hashlib.sha256((report.path / relative).read_bytes()).hexdigest(), relative


def test_xxhash_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` raise ImportError
    with pytest.raises(CheckpointError, match="xxhash package"):
        CheckpointPublisher(tmp_path, hash_algorithm="xxh3_128")
    with pytest.raises(CheckpointError, match="unknown hash algorithm 'md5'"):
        CheckpointPublisher(tmp_path, hash_algorithm="md5")


def test_republish_replaces_the_step(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    first = publisher.publish(7, payload_writer("old"))
    recorder.calls.clear()
    second = publisher.publish(7, payload_writer("new"))

    assert second.path == first.path and (second.path / "job.yaml").read_text() == "tag: new\n"
    verify_checkpoint(second.path)
    assert published_names(tmp_path) == ["step_00000007"] and hidden_names(tmp_path) == []
    retire = next(call for call in recorder.calls if call[0] == "rename" and call[1] == str(first.path))
    retired = retire[2]
    assert ".step_00000007.retired-" in retired
    install = next(
        index for index, call in enumerate(recorder.calls) if call[0] == "rename" and call[2] == str(first.path)
    )
    assert (
        recorder.calls.index(retire)
        < install
        < recorder.index("fsync_dir", tmp_path)
        < recorder.index("remove_tree", retired)
    )


def test_crash_between_republish_renames_is_recovered(tmp_path, recorder, caplog):
    publisher = CheckpointPublisher(tmp_path)
    publisher.publish(3, payload_writer("three"))
    publisher.publish(7, payload_writer("old"))
    recorder.faults["rename"] = lambda source, destination: (
        SimulatedCrash() if ".staging-" in Path(source).name else None
    )
    with pytest.raises(SimulatedCrash):
        publisher.publish(7, payload_writer("new"))

    # Only the retired old copy of step 7 exists; it is never taken for a checkpoint as is.
    assert published_names(tmp_path) == ["step_00000003"]
    assert [kind for kind, _, _ in list_hidden(tmp_path)] == ["retired", "staging"]
    assert find_latest(tmp_path) == tmp_path / "step_00000003"
    assert "cleanup_stale() restores it" in caplog.text

    recorder.faults.clear()
    report = cleanup_stale(tmp_path)
    assert report.recovered == [tmp_path / "step_00000007"] and len(report.removed) == 1
    assert hidden_names(tmp_path) == []
    assert find_latest(tmp_path, verify=True) == tmp_path / "step_00000007"
    assert (tmp_path / "step_00000007" / "job.yaml").read_text() == "tag: old\n"


def test_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    publisher.publish(7, payload_writer("old"))
    recorder.faults["rename"] = lambda source, destination: (
        OSError(errno.EIO, "injected rename failure") if ".staging-" in Path(source).name else None
    )
    with pytest.raises(CheckpointError, match="phase 'publish' on rank 0: OSError"):
        publisher.publish(7, payload_writer("new"))
    assert hidden_names(tmp_path) == []
    verify_checkpoint(tmp_path / "step_00000007")
    assert (tmp_path / "step_00000007" / "job.yaml").read_text() == "tag: old\n"


def test_retention_keeps_the_newest(tmp_path):
    (tmp_path / "step_00000000" / "policy").mkdir(parents=True)  # legacy: never counted, never deleted
    publisher = CheckpointPublisher(tmp_path, keep_last=2)
    removed = [publisher.publish(step, payload_writer(str(step))).removed for step in (1, 2, 3, 4, 5)]
    assert removed[:2] == [(), ()] and removed[2] == (tmp_path / "step_00000001",)
    assert published_names(tmp_path) == ["step_00000000", "step_00000004", "step_00000005"]
    assert hidden_names(tmp_path) == []


def test_retention_removes_a_derived_form_with_its_checkpoint(tmp_path):
    (tmp_path / "step_00000000" / "policy").mkdir(parents=True)  # legacy original: its derived form stays
    publisher, derived = CheckpointPublisher(tmp_path, keep_last=2), CheckpointPublisher(tmp_path / "portable")
    for step in (0, 1, 2):
        if step:
            publisher.publish(step, payload_writer(str(step)))
        derived.publish(step, payload_writer(f"portable {step}"))
    report = publisher.publish(3, payload_writer("3"))
    assert report.removed == (tmp_path / "step_00000001", tmp_path / "portable" / "step_00000001")
    assert published_names(tmp_path / "portable") == ["step_00000000", "step_00000002"]
    assert hidden_names(tmp_path / "portable") == []
    verify_checkpoint(tmp_path / "portable" / "step_00000002")


def test_retention_never_deletes_the_one_just_published_nor_the_newest_valid(tmp_path):
    keep_all = CheckpointPublisher(tmp_path)
    for step in (10, 20, 30):
        keep_all.publish(step, payload_writer(str(step)))
    (tmp_path / "step_00000040").mkdir()
    (tmp_path / "step_00000040" / MANIFEST_NAME).write_text("{broken")  # invalid: not counted, left alone
    report = CheckpointPublisher(tmp_path, keep_last=1).publish(15, payload_writer("15"))
    assert set(report.removed) == {tmp_path / "step_00000010", tmp_path / "step_00000020"}
    assert published_names(tmp_path) == ["step_00000015", "step_00000030", "step_00000040"]


def test_crash_during_retention_never_leaves_a_half_deleted_published_dir(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path, keep_last=1)
    publisher.publish(1, payload_writer("1"))
    recorder.faults["remove_tree"] = lambda path: SimulatedCrash() if ".retired-" in Path(path).name else None
    with pytest.raises(SimulatedCrash):
        publisher.publish(2, payload_writer("2"))

    assert published_names(tmp_path) == ["step_00000002"]
    verify_checkpoint(tmp_path / "step_00000002")
    [(kind, step, retired)] = list_hidden(tmp_path)
    assert (kind, step) == ("retired", 1) and not (retired / MANIFEST_NAME).exists()
    recorder.faults.clear()
    report = cleanup_stale(tmp_path)
    assert report.recovered == [] and report.removed == [retired] and hidden_names(tmp_path) == []


def test_failing_retention_does_not_fail_the_save(tmp_path, recorder, caplog):
    publisher = CheckpointPublisher(tmp_path, keep_last=1)
    publisher.publish(1, payload_writer("1"))
    recorder.faults["remove_tree"] = lambda path: OSError(errno.EACCES, "injected")
    report = publisher.publish(2, payload_writer("2"))
    assert report.removed == () and "retention failed" in caplog.text
    assert published_names(tmp_path) == ["step_00000002"]


def test_eio_from_fsync_aborts_without_retry(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    previous = publisher.publish(1, payload_writer("1")).path
    recorder.calls.clear()
    recorder.faults["fsync_file"] = lambda path: (
        OSError(errno.EIO, "Input/output error", str(path)) if Path(path).name == "optim_states.pt" else None
    )
    written = []
    with pytest.raises(CheckpointError) as raised:
        publisher.publish(2, payload_writer("2", written))

    message = str(raised.value)
    assert (
        "phase 'hash' on rank 0" in message and "Input/output error" in message and "nothing was published" in message
    )
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.EIO
    assert len(written) == 1  # no retry
    assert (
        len([call for call in recorder.calls if call[0] == "fsync_file" and call[1].endswith("optim_states.pt")]) == 1
    )
    assert published_names(tmp_path) == [previous.name] and hidden_names(tmp_path) == []
    verify_checkpoint(previous)


def test_enospc_from_the_manifest_write(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    previous = publisher.publish(1, payload_writer("1")).path
    recorder.faults["write_bytes"] = lambda path, data: OSError(errno.ENOSPC, "No space left on device", str(path))
    with pytest.raises(CheckpointError, match=r"No space left on device.*out of disk space"):
        publisher.publish(2, payload_writer("2"))
    assert published_names(tmp_path) == [previous.name] and hidden_names(tmp_path) == []
    verify_checkpoint(previous)


def test_failing_write_callback_is_chained_and_cleaned_up(tmp_path):
    publisher = CheckpointPublisher(tmp_path)
    previous = publisher.publish(1, payload_writer("1")).path

    def write(staging: Path) -> None:
        (staging / "partial.bin").write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="checkpoint save step 2 failed in phase 'write' on rank 0") as raised:
        publisher.publish(2, write)
    assert isinstance(raised.value.__cause__, OSError)
    assert published_names(tmp_path) == [previous.name] and hidden_names(tmp_path) == []
    verify_checkpoint(previous)


def test_order_of_operations(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    report = publisher.publish(9, payload_writer())
    [make] = [call for call in recorder.calls if call[0] == "make_dir"]
    staging = Path(make[1])
    publish_rename = recorder.index("rename", staging, report.path)
    manifest_rename = recorder.index("rename", staging / "manifest.json.tmp", staging / MANIFEST_NAME)
    for relative in read_manifest(report.path).files:
        assert recorder.index("fsync_file", staging / relative) < manifest_rename  # manifest written last
    assert recorder.index("fsync_file", staging / "manifest.json.tmp") < manifest_rename
    assert manifest_rename < recorder.index("fsync_dir", staging) < publish_rename
    for directory in (staging / "policy", staging / "policy" / "zero"):
        assert recorder.index("fsync_dir", directory) < publish_rename
    assert publish_rename < recorder.index("fsync_dir", tmp_path)  # parent fsynced after the rename
    assert recorder.calls[-1] == ("fsync_dir", str(tmp_path))


def test_pre_publish_runs_just_before_the_rename(tmp_path):
    seen = []

    def flush_metrics() -> None:
        [staging] = [path for path in tmp_path.iterdir() if ".staging-" in path.name]
        seen.append(((staging / MANIFEST_NAME).exists(), (tmp_path / step_dir_name(4)).exists()))

    publisher = CheckpointPublisher(tmp_path)
    publisher.publish(4, payload_writer(), pre_publish=flush_metrics)
    assert seen == [(True, False)]

    def failing_hook() -> None:
        raise OSError(errno.EIO, "metrics.jsonl fsync failed")

    with pytest.raises(CheckpointError, match="phase 'publish'.*metrics.jsonl fsync failed"):
        publisher.publish(5, payload_writer(), pre_publish=failing_hook)
    assert published_names(tmp_path) == ["step_00000004"] and hidden_names(tmp_path) == []


def test_the_payload_is_checked_against_parts_and_manifest_name(tmp_path):
    publisher = CheckpointPublisher(tmp_path, parts=["policy", "critic"])
    with pytest.raises(CheckpointError, match="no files for the part.s. critic"):
        publisher.publish(1, payload_writer())

    def writes_a_manifest(staging: Path) -> None:
        payload_writer()(staging)
        (staging / "critic").mkdir()
        (staging / "critic" / "weights.pt").write_bytes(b"1")
        (staging / MANIFEST_NAME).write_text("{}")

    with pytest.raises(CheckpointError, match="must not create manifest.json"):
        publisher.publish(1, writes_a_manifest)
    with pytest.raises(CheckpointError, match="phase 'publish'.*not JSON serializable"):
        CheckpointPublisher(tmp_path).publish(1, payload_writer(), meta={"bad": object()})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        CheckpointPublisher(tmp_path, parts=["../escape"])
    with pytest.raises(ValueError):
        CheckpointPublisher(tmp_path, keep_last=0)


def test_a_stalled_collective_removes_staging_and_retires_the_group(tmp_path):
    from astrai.checkpoint.collective import PhaseStalledError

    class StallingGroup:
        """Stands in for a gloo group whose peer died during the hash phase."""

        rank, world_size = 0, 1

        def exchange(self, phase, value, context):
            if phase == "hash":
                raise PhaseStalledError(f"{context}: phase '{phase}' did not complete within 1 s; a rank died or hung")
            return [value]

    publisher = CheckpointPublisher(tmp_path)
    publisher._group = StallingGroup()
    with pytest.raises(CheckpointError, match="phase 'hash' did not complete"):
        publisher.publish(1, payload_writer())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="unusable after an earlier failure"):
        publisher.publish(2, payload_writer())


# --- publish_async: phases 5-6 in a background thread -----------------------------------------


def hold_fsyncs(recorder: FsRecorder):
    """Make every file fsync wait for the returned event (the real fsync follows): a disk that is slow
    on purpose, so that what the caller can do before the save is durable is observable, not a race."""
    import threading

    gate = threading.Event()

    def held(path):
        assert gate.wait(timeout=30), "the test never released the fsyncs"
        return None

    recorder.faults["fsync_file"] = held
    return gate


def test_publish_async_returns_before_the_save_is_durable_and_wait_publishes_it(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path, parts=["policy"])
    gate = hold_fsyncs(recorder)
    blocked = publisher.publish_async(7, payload_writer("7"), meta={"run": "async"})

    # Returned with the shards written but nothing fsynced: not visible, not taken by a resume.
    assert blocked >= 0 and publisher.pending_step == 7
    assert published_names(tmp_path) == [] and find_latest(tmp_path) is None
    (staging,) = [tmp_path / name for name in hidden_names(tmp_path)]
    assert ".staging-" in staging.name and (staging / "policy" / "mp_rank_00_model_states.pt").is_file()
    assert not (staging / MANIFEST_NAME).exists()

    gate.set()
    report = publisher.wait()
    assert publisher.pending_step is None and publisher.wait() is None
    assert report.path == tmp_path / step_dir_name(7) and report.blocked_s == blocked <= report.seconds
    assert read_manifest(report.path).meta == {"run": "async"} and verify_checkpoint(report.path).files == 4
    assert hidden_names(tmp_path) == [] and find_latest(tmp_path) == report.path
    # The background half keeps the publisher's order: every file fsynced, then the manifest, then the rename.
    manifest_rename = recorder.index("rename", staging / "manifest.json.tmp", staging / MANIFEST_NAME)
    for relative in read_manifest(report.path).files:
        assert recorder.index("fsync_file", staging / relative) < manifest_rename
    assert manifest_rename < recorder.index("rename", staging, report.path)


def test_publish_async_runs_pre_publish_in_the_background_just_before_the_rename(tmp_path, recorder):
    """The trainer's last check (an orphaned rank leaves here) runs after the manifest, before the rename."""
    publisher = CheckpointPublisher(tmp_path, parts=["policy"])
    seen = []
    publisher.publish_async(3, payload_writer("3"), pre_publish=lambda: seen.append(sorted(hidden_names(tmp_path))))
    report = publisher.wait()
    (staging_names,) = seen
    assert len(staging_names) == 1 and ".staging-" in staging_names[0]  # not yet renamed when it ran
    staging = tmp_path / staging_names[0]
    assert recorder.index("rename", staging / "manifest.json.tmp", staging / MANIFEST_NAME) < recorder.index(
        "rename", staging, report.path
    )

    def refuse():
        raise CheckpointError("the launcher is gone")

    publisher.publish_async(4, payload_writer("4"), pre_publish=refuse)
    with pytest.raises(CheckpointError, match="the launcher is gone"):
        publisher.wait()
    assert published_names(tmp_path) == [report.path.name]  # step 4 never appeared


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path, keep_last=1)
    gate = hold_fsyncs(recorder)
    publisher.publish_async(1, payload_writer("1"))
    import threading

    threading.Timer(0.2, gate.set).start()  # the second save can start only once the first has published
    second = publisher.publish(2, payload_writer("2"))
    assert published_names(tmp_path) == ["step_00000002"] and second.blocked_s == second.seconds
    assert json.loads((second.path / "trainer_state.json").read_text()) == {"tag": "2"}
    staged = [call for call in recorder.calls if call[0] == "make_dir" and ".staging-" in call[1]]
    renames = [i for i, call in enumerate(recorder.calls) if call[0] == "rename" and call[2].endswith("step_00000001")]
    assert len(staged) == 2 and renames and renames[0] < recorder.calls.index(staged[1])


def test_a_background_failure_is_raised_by_wait_and_loses_nothing(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    previous = publisher.publish(1, payload_writer("1")).path
    recorder.faults["fsync_file"] = lambda path: (
        OSError(errno.EIO, "Input/output error", str(path)) if Path(path).name == "optim_states.pt" else None
    )
    publisher.publish_async(2, payload_writer("2"))  # the write phase succeeds: the error comes later
    with pytest.raises(CheckpointError) as raised:
        publisher.wait()
    message = str(raised.value)
    assert (
        message.startswith("background checkpoint save step 2 failed in phase 'hash'")
        and "Input/output error" in message
    )
    assert isinstance(raised.value.__cause__, CheckpointError)
    assert published_names(tmp_path) == [previous.name] and hidden_names(tmp_path) == []
    verify_checkpoint(previous)
    # Raised once: the publisher is usable again, and the next save publishes.
    recorder.faults.clear()
    assert publisher.publish(3, payload_writer("3")).path.name == "step_00000003"


def test_a_background_failure_surfaces_at_the_next_save(tmp_path, recorder):
    publisher = CheckpointPublisher(tmp_path)
    recorder.faults["write_bytes"] = lambda path, data: OSError(errno.ENOSPC, "No space left on device", str(path))
    publisher.publish_async(1, payload_writer("1"))
    with pytest.raises(CheckpointError, match=r"background checkpoint save step 1 failed.*out of disk space"):
        publisher.publish_async(2, payload_writer("2"))
    assert published_names(tmp_path) == [] and hidden_names(tmp_path) == []


def streamed_writer(files, *, after=None):
    """payload_writer's files, the two shards written through `files` (StreamedFiles); returns their digests."""

    def write(staging: Path):
        (staging / "policy" / "zero").mkdir(parents=True)
        for relative, text in (
            ("policy/mp_rank_00_model_states.pt", b"model" * 5000),
            ("policy/zero/optim_states.pt", b"optim" * 9000),
        ):
            with files.open(staging / relative) as handle:
                handle.write(text)
        (staging / "job.yaml").write_text("tag: streamed\n")
        if after is not None:
            after(staging)
        return files.digests_under(staging)

    return write


def test_files_hashed_while_written_are_fsynced_not_read_back(tmp_path, recorder, monkeypatch):
    import astrai.checkpoint.hashing as hashing

    read_back = []
    real_digest = hashing._digest
    monkeypatch.setattr(
        hashing, "_digest", lambda path, algorithm: read_back.append(Path(path).name) or real_digest(path, algorithm)
    )
    report = CheckpointPublisher(tmp_path, parts=["policy"]).publish(4, streamed_writer(StreamedFiles("sha256")))
    assert report.files == 3 and report.hashed_while_written == 2
    assert read_back == ["job.yaml"]  # the shards' digests came from their writes
    manifest = read_manifest(report.path)
    assert manifest.files["policy/zero/optim_states.pt"].size == 5 * 9000
    verify_checkpoint(report.path)  # re-reads every file: the streamed digests are those of the bytes on disk
    [make] = [call for call in recorder.calls if call[0] == "make_dir"]
    staging = Path(make[1])
    manifest_rename = recorder.index("rename", staging / "manifest.json.tmp", staging / MANIFEST_NAME)
    for relative in manifest.files:  # durable before the manifest, streamed or not
        assert recorder.index("fsync_file", staging / relative) < manifest_rename


def test_a_streamed_file_changed_afterwards_is_hashed_again(tmp_path, caplog):
    def append(staging: Path) -> None:
        with open(staging / "policy" / "zero" / "optim_states.pt", "ab") as handle:
            handle.write(b"late")

    report = CheckpointPublisher(tmp_path).publish(5, streamed_writer(StreamedFiles("sha256"), after=append))
    assert read_manifest(report.path).files["policy/zero/optim_states.pt"].size == 5 * 9000 + 4
    verify_checkpoint(report.path)
    assert "changed size after it was hashed while written" in caplog.text


def test_a_digest_for_a_file_not_in_the_staging_directory_fails_the_save(tmp_path):
    files = StreamedFiles("sha256")
    previous = CheckpointPublisher(tmp_path).publish(1, payload_writer()).path

    def remove(staging: Path) -> None:
        (staging / "policy" / "mp_rank_00_model_states.pt").unlink()

    with pytest.raises(
        CheckpointError, match="reported a digest for 'policy/mp_rank_00_model_states.pt'.*nothing was published"
    ):
        CheckpointPublisher(tmp_path).publish(2, streamed_writer(files, after=remove))
    assert published_names(tmp_path) == [previous.name] and hidden_names(tmp_path) == []
