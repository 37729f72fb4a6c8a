"""Checkpoint files written in one pass (astrai.checkpoint.stream): real files, real sync_file_range,
real torch.save, and a real one-rank DeepSpeed engine saving through them."""

from __future__ import annotations

import errno
import hashlib
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.checkpoint import CheckpointError, StreamedFile, StreamedFiles, fs
from astrai.checkpoint.hashing import hash_file

KIB = 1024


@pytest.fixture
def writebacks(monkeypatch):
    """Every start_writeback call as (offset, length, taken), passed on to the real one."""
    calls = []
    real = fs.start_writeback

    def recording(descriptor, offset, length):
        taken = real(descriptor, offset, length)
        calls.append((offset, length, taken))
        return taken

    monkeypatch.setattr(fs, "start_writeback", recording)
    return calls


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b", "xxh3_128"])
def test_the_digest_is_that_of_the_file_on_disk(tmp_path, algorithm):
    payload = os.urandom(300 * KIB)
    with StreamedFile(tmp_path / "f.bin", algorithm, writeback_bytes=64 * KIB) as handle:
        for start in range(0, len(payload), 7000):  # uneven pieces, as a serialiser writes them
            assert handle.write(payload[start : start + 7000]) == len(payload[start : start + 7000])
    assert (tmp_path / "f.bin").read_bytes() == payload
    assert handle.digest == hash_file(tmp_path / "f.bin", algorithm)
    assert handle.digest.size == len(payload)


def test_writeback_is_started_slice_by_slice_while_writing(tmp_path, writebacks):
    payload = os.urandom(1000 * KIB)
    handle = StreamedFile(tmp_path / "f.bin", "sha256", writeback_bytes=64 * KIB)
    handle.write(payload)  # one large write (a tensor's storage) still streams in slices
    during_the_write = list(writebacks)
    handle.close()
    assert len(during_the_write) == 1000 // 64
    assert all(length == 64 * KIB for _, length, _ in during_the_write)
    # The ranges cover the file once, in order, the tail at close.
    position = 0
    for offset, length, _ in writebacks:
        assert offset == position
        position += length
    assert position == len(payload)
    if sys.platform == "linux":
        assert all(taken for _, _, taken in writebacks)  # the kernel took every request


def test_torch_save_through_it_loads_back(tmp_path):
    state = {"weight": torch.randn(256, 300), "step": 7, "nested": {"moment": torch.arange(5000, dtype=torch.float64)}}
    with StreamedFile(tmp_path / "streamed.pt", "sha256", writeback_bytes=32 * KIB) as handle:
        torch.save(state, handle)
    loaded = torch.load(tmp_path / "streamed.pt")
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["step"] == 7
    assert torch.equal(loaded["nested"]["moment"], state["nested"]["moment"])
    assert handle.digest == hash_file(tmp_path / "streamed.pt", "sha256")


def test_without_an_algorithm_it_only_streams(tmp_path, writebacks):
    files = StreamedFiles(None, writeback_bytes=16 * KIB)
    with files.open(tmp_path / "f.bin") as handle:
        handle.write(b"x" * 40 * KIB)
    assert handle.digest is None and files.digests_under(tmp_path) == {}
    assert sum(length for _, length, _ in writebacks) == 40 * KIB


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fail a write with ENOSPC")
def test_a_failed_write_leaves_no_digest(tmp_path):
    files = StreamedFiles("sha256")
    handle = files.open("/dev/full")
    with pytest.raises(OSError) as raised:
        handle.write(b"y" * 1000)
    handle.close()
    assert raised.value.errno == errno.ENOSPC
    assert handle.digest is None and files.digests_under("/dev") == {}
    with pytest.raises(ValueError, match="closed"):
        handle.write(b"z")


def test_a_serialiser_failing_between_writes_leaves_no_digest(tmp_path):
    files = StreamedFiles("sha256")
    with pytest.raises(RuntimeError, match="pickling failed"):
        with files.open(tmp_path / "f.pt") as handle:
            handle.write(b"header")
            raise RuntimeError("pickling failed")
    assert handle.closed and handle.digest is None and files.digests_under(tmp_path) == {}


def test_bytes_that_cannot_be_read_back_fail_the_close(tmp_path):
    # The hash follows the writer by reading the file back: a file cut short under it is an error, not a digest.
    handle = StreamedFile(tmp_path / "f.bin", "sha256", writeback_bytes=32 * KIB)
    handle.write(os.urandom(100 * KIB))
    os.truncate(tmp_path / "f.bin", 0)
    with pytest.raises(OSError, match="could not be read back"):
        handle.close()
    assert handle.closed and handle.digest is None


def test_digests_under_a_root_are_relative_posix_paths(tmp_path):
    files = StreamedFiles("sha256")
    (tmp_path / "staging" / "policy" / "state").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for path in (
        tmp_path / "staging" / "policy" / "state" / "a.pt",
        tmp_path / "staging" / "b.pt",
        tmp_path / "elsewhere" / "c.pt",
    ):
        with files.open(path) as handle:
            handle.write(path.name.encode())
    digests = files.digests_under(tmp_path / "staging")
    assert sorted(digests) == ["b.pt", "policy/state/a.pt"]
    assert digests["b.pt"].digest == hashlib.sha256(b"b.pt").hexdigest() and digests["b.pt"].size == 4


def test_an_unknown_algorithm_fails_before_any_file_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="unknown hash algorithm 'md4'"):
        StreamedFiles("md4")
    with pytest.raises(ValueError, match="writeback_bytes"):
        StreamedFile(tmp_path / "f", None, writeback_bytes=0)


def test_a_deepspeed_engine_saves_every_shard_through_the_stream(one_rank, tmp_path):
    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config, make_engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
    )
    config = build_ds_config(
        DeepSpeedSection(zero_stage=0),
        template_path=None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=1.0,
        precision="fp32",
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        world_size=1,
    )
    engine = make_engine(model, config, weight_decay=0.0, schedule=lambda completed: 1.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    default_engine = engine._engine.checkpoint_engine

    files = StreamedFiles("sha256", writeback_bytes=8 * KIB)
    engine.save(tmp_path / "streamed", open_file=files.open)
    assert engine._engine.checkpoint_engine is default_engine  # put back after the save
    digests = files.digests_under(tmp_path / "streamed")
    shards = sorted(
        path.relative_to(tmp_path / "streamed").as_posix() for path in (tmp_path / "streamed").rglob("*.pt")
    )
    assert shards and sorted(digests) == shards  # every DeepSpeed file went through the stream
    for relative, digest in digests.items():
        assert digest == hash_file(tmp_path / "streamed" / relative, "sha256")

    # The same engine loads what it streamed: weights and optimizer state as they were.
    before = {name: tensor.clone() for name, tensor in engine.module.state_dict().items()}
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.load(tmp_path / "streamed")
    assert all(torch.equal(engine.module.state_dict()[name], tensor) for name, tensor in before.items())

    # A checkpoint engine the user configured (anything but DeepSpeed's default) is left to do its own writing.
    class OwnWriter(type(default_engine)):
        pass

    engine._engine.checkpoint_engine = own = OwnWriter()
    other = StreamedFiles("sha256")
    engine.save(tmp_path / "own", open_file=other.open)
    assert other.digests_under(tmp_path / "own") == {} and list((tmp_path / "own").rglob("*.pt"))
    assert engine._engine.checkpoint_engine is own
    engine._engine.checkpoint_engine = default_engine
