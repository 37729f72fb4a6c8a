"""Topology-change pieces that need no ranks: detection, the data-position rule, the portable form
read from a ZeRO-0 checkpoint (built here by hand in DeepSpeed's file layout, with a tied weight),
filling a torch optimizer from it, conversion through the publisher (reuse, crash), the CLI.

The ZeRO-1/2/3 paths (ds_to_universal, partitioned layouts) need real ranks:
tests/integration/test_topology_ranks.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai.checkpoint import CheckpointError, CheckpointPublisher, find_latest, read_manifest, verify_checkpoint
from astrai.engine import PARAMETER_NAMES_KEY, Engine, parameter_groups
from astrai.resume import portable, topology
from astrai.resume.portable import PortablePart, write_portable_part
from astrai.resume.topology import continue_position, convert, convert_main, describe_change, portable_path

STEPS = 3


class TiedModel(torch.nn.Module):
    """Embedding [11, 4] shared with the output head, a [4, 4] matrix and a 1-D norm weight."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.inner = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            self.head(self.inner(self.embed(ids)) * self.norm).flatten(0, 1), ids.flatten()
        )


def warmup(done: int) -> float:
    return min(1.0, (done + 1) / 8)


def trained(steps: int = STEPS):
    """(model, AdamW over engine.parameter_groups, LambdaLR, batches) after `steps` updates."""
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    batches = [torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(i)) for i in range(steps + 2)]
    for ids in batches[:steps]:
        update(model, optimizer, scheduler, ids)
    return model, optimizer, scheduler, batches


def update(model, optimizer, scheduler, ids) -> float:
    loss = model(ids)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(loss.detach())


def model_states(model, optimizer, scheduler, record_names: bool) -> dict:
    """What DeepSpeed's ZeRO-0 `mp_rank_00_model_states.pt` holds (the keys the converter reads)."""
    states = {
        "module": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "buffer_names": [],
        "lr_scheduler": scheduler.state_dict(),
        "global_steps": STEPS,
        "global_samples": STEPS * 8,
        "skipped_steps": 0,
        "ds_config": {"zero_optimization": {"stage": 0}},
    }
    if record_names:
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        states[PARAMETER_NAMES_KEY] = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    return states


def publish_checkpoint(checkpoints: Path, states: dict, *, world_size: int = 2) -> Path:
    def write(staging: Path) -> None:
        (staging / "policy" / "state").mkdir(parents=True)
        torch.save(states, staging / "policy" / "state" / "mp_rank_00_model_states.pt")
        (staging / "trainer_state.json").write_text(json.dumps({"step": STEPS, "consumed_samples": STEPS * 8}))
        (staging / "job.yaml").write_text("train: {seed: 7}\n")

    meta = {"train_type": "sft", "world_size": world_size, "zero_stage": {"policy": 0}, "precision": {"policy": "fp32"}}
    return CheckpointPublisher(checkpoints, parts=["policy"]).publish(STEPS, write, meta=meta).path


@pytest.fixture
def checkpoint(tmp_path):
    model, optimizer, scheduler, _ = trained()
    return publish_checkpoint(tmp_path / "checkpoints", model_states(model, optimizer, scheduler, record_names=True))


def test_describe_change_names_each_difference():
    recorded = {"world_size": 2, "zero_stage": {"policy": 2, "critic": 2}, "precision": {"policy": "bf16"}}
    current = {"world_size": 1, "zero_stage": {"policy": 0, "critic": 2}, "precision": {"policy": "bf16"}}
    assert describe_change(recorded, current) == "world size 2 -> 1; policy ZeRO-2 -> ZeRO-0"
    assert describe_change(recorded, {**recorded}) is None
    assert describe_change(recorded, {**recorded, "precision": {"policy": "fp32"}}) == "policy bf16 -> fp32"


def test_data_position_rounds_up_to_the_new_global_micro_batch():
    assert continue_position(32, 8) == 32  # global batch kept: exactly where the stream stopped
    assert continue_position(24, 16) == 32  # 8 samples skipped, never repeated
    assert continue_position(0, 6) == 0


@pytest.mark.parametrize("record_names", [True, False], ids=["recorded-names", "guessed-names"])
def test_stage0_checkpoint_reads_into_full_tensors(tmp_path, record_names):
    model, optimizer, scheduler, _ = trained()
    shards = tmp_path / "policy" / "state"
    shards.mkdir(parents=True)
    torch.save(model_states(model, optimizer, scheduler, record_names), shards / "mp_rank_00_model_states.pt")
    info = write_portable_part(tmp_path / "policy", tmp_path / "out", tmp_path / "scratch", "state")
    assert info.names == ["embed.weight", "inner.weight", "norm"]  # the tied head counted once
    assert (info.optimizer_step, info.global_steps, info.global_samples, info.source_zero_stage) == (
        STEPS,
        STEPS,
        STEPS * 8,
        0,
    )
    assert info.lr_scheduler["last_epoch"] == STEPS and not (tmp_path / "scratch").exists()
    part = PortablePart(tmp_path / "out")
    for name, parameter in model.named_parameters():
        assert torch.equal(part.tensor("fp32", name), parameter.detach())
        assert torch.equal(part.tensor("exp_avg", name), optimizer.state[parameter]["exp_avg"])
        assert torch.equal(part.tensor("exp_avg_sq", name), optimizer.state[parameter]["exp_avg_sq"])


def test_filled_optimizer_continues_the_run_exactly(checkpoint, tmp_path):
    """The next two updates after loading the portable form equal those of the uninterrupted run."""
    model, optimizer, scheduler, batches = trained()
    write_portable_part(checkpoint / "policy", tmp_path / "out", tmp_path / "scratch", "state")
    lr = optimizer.param_groups[0]["lr"]
    straight = [update(model, optimizer, scheduler, ids) for ids in batches[STEPS:]]
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    fresh = TiedModel()
    fresh_optimizer = torch.optim.AdamW(parameter_groups(fresh, 0.1), lr=1e-2)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, warmup)
    engine = Engine(
        SimpleNamespace(module=fresh, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler, global_steps=0),
        {"zero_optimization": {"stage": 0}},
    )
    engine.load_full_state(PortablePart(tmp_path / "out"))
    assert [group["lr"] for group in fresh_optimizer.param_groups] == [lr, lr] == [1e-2 * warmup(STEPS)] * 2
    assert engine.global_steps == STEPS and fresh.head.weight is fresh.embed.weight
    resumed = [update(fresh, fresh_optimizer, fresh_scheduler, ids) for ids in batches[STEPS:]]
    assert resumed == straight  # bitwise: same weights, moments, step and LR
    for (name, expected), (_, actual) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(expected, actual), name


def test_fill_rejects_a_model_with_other_parameters(checkpoint, tmp_path):
    write_portable_part(checkpoint / "policy", tmp_path / "out", tmp_path / "scratch", "state")
    other = torch.nn.Linear(4, 4)
    engine = Engine(
        SimpleNamespace(module=other, optimizer=torch.optim.AdamW(other.parameters())),
        {"zero_optimization": {"stage": 0}},
    )
    with pytest.raises(ValueError, match="differ from the model's"):
        engine.load_full_state(PortablePart(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="cannot load"):
        topology.load_portable_part(engine, tmp_path / "out")


def test_convert_publishes_next_to_the_original_and_reuses_it(checkpoint):
    before = verify_checkpoint(checkpoint)
    converted = convert(checkpoint, target={"world_size": 1})
    assert converted == portable_path(checkpoint) == checkpoint.parent / "portable" / checkpoint.name
    manifest = read_manifest(converted)
    assert manifest.parts == ("policy",) and manifest.step == STEPS
    assert manifest.meta["layout"] == "portable" and manifest.meta["source"]["world_size"] == 2
    assert manifest.meta["target"] == {"world_size": 1} and manifest.meta["train_type"] == "sft"
    assert sorted(name for name in manifest.files) == [
        "job.yaml",
        "policy/exp_avg.safetensors",
        "policy/exp_avg_sq.safetensors",
        "policy/fp32.safetensors",
        "policy/portable.json",
        "trainer_state.json",
    ]
    verify_checkpoint(converted)
    assert verify_checkpoint(checkpoint).files == before.files  # the original is untouched
    assert find_latest(checkpoint.parent) == checkpoint  # portable/ is never taken for a checkpoint
    inode = converted.stat().st_ino
    assert convert(checkpoint) == converted and converted.stat().st_ino == inode  # reused, not rewritten
    assert convert(converted) == converted  # a portable checkpoint needs no conversion


def test_convert_again_when_the_original_was_republished(checkpoint):
    converted = convert(checkpoint)
    inode = converted.stat().st_ino
    model, optimizer, scheduler, _ = trained(STEPS)
    publish_checkpoint(checkpoint.parent, model_states(model, optimizer, scheduler, record_names=False), world_size=4)
    assert convert(checkpoint).stat().st_ino != inode
    assert read_manifest(converted).meta["source"]["world_size"] == 4


def test_a_failed_conversion_leaves_nothing_visible_and_the_original_usable(checkpoint, monkeypatch):
    real_save = portable.save_file

    def fail_after_first(tensors, path):  # the fp32 file is written, then the disk "fails"
        real_save(tensors, path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(portable, "save_file", fail_after_first)
    with pytest.raises(CheckpointError, match="phase 'write'.*No space left"):
        convert(checkpoint)
    assert os.listdir(checkpoint.parent / "portable") == []  # the staging folder was removed
    verify_checkpoint(checkpoint)
    monkeypatch.setattr(portable, "save_file", real_save)
    verify_checkpoint(convert(checkpoint))


def test_a_killed_conversion_leaves_only_a_hidden_staging_folder(checkpoint):
    """kill -9 in the middle of writing: what the next attempt finds, and cleans up."""
    import subprocess
    import sys

    from tests.conftest import REPO, child_env

    script = (
        "import os, signal, sys; from astrai.resume import portable, topology\n"
        "real = portable.save_file\n"
        "def die(tensors, path):\n    real(tensors, path); os.kill(os.getpid(), signal.SIGKILL)\n"
        "portable.save_file = die\n"
        f"sys.exit(topology.convert_main([{str(checkpoint)!r}]))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == -9, completed.stderr[-2000:]
    leftovers = os.listdir(checkpoint.parent / "portable")
    assert len(leftovers) == 1 and leftovers[0].startswith(".step_") and ".staging-" in leftovers[0]
    verify_checkpoint(checkpoint)
    assert find_latest(checkpoint.parent) == checkpoint and find_latest(checkpoint.parent / "portable") is None
    converted = convert(checkpoint)
    assert os.listdir(checkpoint.parent / "portable") == [converted.name]


def test_convert_tool_exit_codes(checkpoint, tmp_path, capsys):
    assert (
        convert_main([str(checkpoint.parent.parent), "--world-size", "4", "--zero-stage", "3"]) == 0
    )  # an output_dir: its newest
    assert capsys.readouterr().out.strip() == str(portable_path(checkpoint))
    assert read_manifest(portable_path(checkpoint)).meta["target"] == {"world_size": 4, "zero_stage": 3}
    assert convert_main([str(tmp_path / "nothing")]) == 1
    assert "no checkpoint found" in capsys.readouterr().err
    for wrong in (["--zero-stage", "5", str(checkpoint)], ["--world-size", "0", str(checkpoint)], []):
        with pytest.raises(SystemExit) as exit_info:
            convert_main(wrong)
        assert exit_info.value.code == 2


def test_convert_refuses_a_checkpoint_without_manifest(tmp_path):
    (tmp_path / "step_5" / "policy").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no manifest"):
        convert(tmp_path / "step_5")


# ---- what cannot carry over exactly: the data position and per-rank RNG, by their stated rules ----


def draws() -> tuple[float, float, float]:
    import random

    import numpy

    return random.random(), float(numpy.random.random()), float(torch.rand(()))


def state_saved_on(world_size: int, *, step: int = 4, consumed: int = 36):
    from astrai.resume.training_checkpoints import TrainerState, capture_rng

    return TrainerState(
        step=step, consumed_samples=consumed, world_size=world_size, rng=[capture_rng() for _ in range(world_size)]
    )


def test_reseed_covers_python_numpy_and_torch_deterministically_per_rank():
    from astrai.resume.training_checkpoints import reseed_rng

    assert reseed_rng(7, 4, 1) == 7 * 7919 + 4 * 31 + 1
    first = draws()
    reseed_rng(7, 4, 1)
    assert draws() == first  # all three generators, the same again
    reseed_rng(7, 4, 0)
    other_rank = draws()
    assert all(a != b for a, b in zip(first, other_rank))


def test_a_changed_world_size_logs_both_rules_once_and_reseeds(caplog):
    from astrai.resume.training_checkpoints import carry_over, reseed_rng

    logs = []
    for rank in (0, 1, 2):
        state = state_saved_on(2)
        with caplog.at_level("INFO", logger="astrai"):
            carry_over(
                state,
                rank=rank,
                world_size=3,
                seed=7,
                samples_per_micro_step=12,
                micro_batch_size=4,
                saved_micro_batch=4,
            )
        logs.append([record.getMessage() for record in caplog.records if record.name == "astrai.checkpointing"])
        caplog.clear()
        drawn = draws()
        reseed_rng(7, 4, rank)
        assert drawn == draws(), f"rank {rank}: not the stated (seed, step, rank) reseed"
        assert state.consumed_samples == 36  # already a multiple of 12
    assert logs[1] == logs[2] == []  # rank 0 alone says it, once per resume
    data, rng = logs[0]
    assert data == (
        "data position: continuing from global sample count 36 (rule: the global sample count carries over, rounded "
        "up to this run's global micro-batch of 12 samples = 4 per rank x world size 3; world size 2 -> 3, "
        "train.micro_batch_size 4 -> 4, 36 samples consumed)"
    )
    assert rng.startswith("RNG reseeded per rank from (seed, step, rank): world size changed (2 -> 3) (rule:")
    assert (
        f"python random, numpy and torch of rank r seeded with seed*7919 + step*31 + r = {7 * 7919 + 4 * 31} + r" in rng
    )


def test_a_changed_micro_batch_on_the_same_world_size_restores_rng_and_says_so(caplog):
    from astrai.resume.training_checkpoints import capture_rng, carry_over, restore_rng

    saved = capture_rng()
    expected = draws()
    state = state_saved_on(2, consumed=36)
    state.rng = [capture_rng(), saved]
    with caplog.at_level("INFO", logger="astrai"):
        carry_over(
            state, rank=1, world_size=2, seed=7, samples_per_micro_step=16, micro_batch_size=8, saved_micro_batch=4
        )
    assert draws() == expected  # rank 1 continues its own saved stream
    assert state.consumed_samples == 48
    assert caplog.messages == [
        "data position: 36 samples consumed is not a multiple of this run's global micro-batch of 16: continuing from "
        "sample 48 (12 samples skipped)"
    ]
    caplog.clear()
    restore_rng(saved)
    with caplog.at_level("INFO", logger="astrai"):
        carry_over(
            state_saved_on(2, consumed=32),
            rank=0,
            world_size=2,
            seed=7,
            samples_per_micro_step=16,
            micro_batch_size=8,
            saved_micro_batch=4,
        )
    assert [message.split(" (rule")[0] for message in caplog.messages] == [
        "data position: continuing from global sample count 32",
        "RNG: each rank's saved state restored",
    ]


def test_an_unchanged_topology_logs_no_rule(caplog):
    from astrai.resume.training_checkpoints import carry_over

    with caplog.at_level("INFO", logger="astrai"):
        carry_over(
            state_saved_on(2, consumed=32),
            rank=0,
            world_size=2,
            seed=7,
            samples_per_micro_step=8,
            micro_batch_size=4,
            saved_micro_batch=4,
        )
    assert caplog.messages == []


def test_the_saved_micro_batch_comes_from_the_checkpoint_job(checkpoint, tmp_path):
    from astrai.resume.training_checkpoints import saved_micro_batch_size

    assert saved_micro_batch_size(checkpoint) is None  # its job.yaml names no train.micro_batch_size
    (tmp_path / "job.yaml").write_text("train: {micro_batch_size: 6, seed: 7}\n")
    assert saved_micro_batch_size(tmp_path) == 6 and saved_micro_batch_size(tmp_path / "missing") is None
