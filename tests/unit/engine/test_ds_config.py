"""The DeepSpeed config built from a job, and the LR schedule (pure: no ranks)."""

from __future__ import annotations

import math

import pytest

from astrai.config.schema import DeepSpeedSection
from astrai.engine import build_ds_config, deep_merge, lr_lambda
from tests.conftest import REPO


def build(section: DeepSpeedSection, template=None, **kwargs):
    settings = dict(
        micro_batch_size=4,
        grad_accum_steps=2,
        max_grad_norm=1.0,
        precision="fp32",
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    settings.update(kwargs)
    return build_ds_config(section, template_path=template, **settings)


def test_template_then_job_then_overrides():
    section = DeepSpeedSection(
        zero_stage=2,
        overrides={"zero_optimization": {"reduce_bucket_size": 1000}, "optimizer": {"params": {"eps": 1e-6}}},
    )
    config = build(section, REPO / "ds_configs/zero3.json")
    assert config["zero_optimization"]["stage"] == 2  # the job's stage beats the template's
    assert config["zero_optimization"]["contiguous_gradients"] is True  # kept from the template
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000  # overrides merged deeply
    assert config["optimizer"]["params"]["eps"] == 1e-6 and config["optimizer"]["params"]["lr"] == 1e-3
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 1.0 and "train_batch_size" not in config


def test_cpu_uses_torch_adam_and_fp32():
    config = build(DeepSpeedSection())
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False


def test_gpu_paths_are_selected_by_config():
    fused = build(DeepSpeedSection(optimizer="fused"), precision="bf16")
    assert "torch_adam" not in fused["optimizer"]["params"] and fused["bf16"]["enabled"] is True
    offloaded = build(DeepSpeedSection(zero_stage=3, offload_optimizer="cpu"))
    assert offloaded["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "torch_adam" not in offloaded["optimizer"]["params"]  # auto picks DeepSpeedCPUAdam
    with pytest.raises(ValueError, match="cpu_adam needs"):
        build(DeepSpeedSection(optimizer="cpu_adam"))


def test_deep_merge_does_not_mutate():
    base = {"a": {"b": 1, "c": 2}}
    merged = deep_merge(base, {"a": {"b": 5}, "d": 3})
    assert merged == {"a": {"b": 5, "c": 2}, "d": 3} and base == {"a": {"b": 1, "c": 2}}


def test_lr_schedule_warmup_then_cosine():
    schedule = lr_lambda(total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    # update u = completed + 1; warmup: u / 2
    assert schedule(0) == 0.5 and schedule(1) == 1.0
    # decay: progress = (u - 2) / 8
    assert schedule(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert schedule(9) == pytest.approx(0.1)
    linear = lr_lambda(total_steps=6, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert [round(linear(k), 4) for k in range(6)] == [0.8333, 0.6667, 0.5, 0.3333, 0.1667, 0.0]
    assert lr_lambda(5, 0, "constant", 0.0)(3) == 1.0


def test_one_rank_runs_zero1_and_2_as_zero0_unless_kept_or_offloaded():
    assert build(DeepSpeedSection(zero_stage=2), world_size=1)["zero_optimization"]["stage"] == 0
    assert build(DeepSpeedSection(zero_stage=1), world_size=1)["zero_optimization"]["stage"] == 0
    assert build(DeepSpeedSection(zero_stage=2), world_size=2)["zero_optimization"]["stage"] == 2
    assert build(DeepSpeedSection(zero_stage=3), world_size=1)["zero_optimization"]["stage"] == 3
    assert (
        build(DeepSpeedSection(zero_stage=2, single_rank_stage0=False), world_size=1)["zero_optimization"]["stage"] == 2
    )
    assert (
        build(DeepSpeedSection(zero_stage=2, offload_optimizer="cpu"), world_size=1)["zero_optimization"]["stage"] == 2
    )


def test_threads_are_split_between_local_ranks(monkeypatch):
    import os

    import torch

    from astrai.engine import pin_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "2")
        assert pin_threads() == max(1, len(os.sched_getaffinity(0)) // 2) == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert pin_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
