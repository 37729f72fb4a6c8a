"""`Engine.skip_update` (train.on_nonfinite: skip_step) on a real single-rank DeepSpeed engine, every ZeRO stage:
the skipped step's gradients are discarded (the next step is exactly that of an engine that never saw
them), no weight, Adam moment or LR-schedule position changes, and DeepSpeed counts the step as skipped.
"""

from __future__ import annotations

import pytest
import torch

from astrai.config.schema import DeepSpeedSection
from astrai.engine import build_ds_config, make_engine
from tests.unit.engine.tiny import tiny_llama


def tiny_engine(zero_stage: int):
    torch.manual_seed(0)
    model = tiny_llama()
    section = DeepSpeedSection(zero_stage=zero_stage, single_rank_stage0=False)
    config = build_ds_config(
        section,
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
    # A schedule that moves every update, so a schedule stepped by the skip would show in the lr.
    return make_engine(model, config, weight_decay=0.01, schedule=lambda completed: 1.0 / (completed + 1))


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))


def train_step(engine, ids: torch.Tensor) -> None:
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def weights(engine) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():
        return {name: parameter.detach().clone() for name, parameter in engine.module.named_parameters()}


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_skipped_update_changes_nothing_and_its_gradients_are_discarded(one_rank, zero_stage):
    skipping, straight = tiny_engine(zero_stage), tiny_engine(zero_stage)
    assert skipping.zero_stage == zero_stage
    for engine in (skipping, straight):
        train_step(engine, batch(1))
    before, lr_before, steps_before = weights(skipping), skipping.lr, skipping.global_steps

    ids = batch(2)
    skipping.backward(skipping(input_ids=ids, labels=ids).loss * 1000.0)  # a large, finite gradient to discard
    skipping.skip_update()
    after = weights(skipping)
    assert all(torch.equal(before[name], after[name]) for name in before), "the skipped update moved a weight"
    assert skipping.lr == lr_before and skipping.skipped_steps == 1 and skipping.global_steps == steps_before + 1

    # The next update is exactly that of an engine that never saw the skipped gradients (none left
    # accumulated, Adam moments and step count untouched); both schedules stood still over the skip.
    train_step(skipping, batch(3))
    train_step(straight, batch(3))
    assert skipping.skipped_steps == 1
    expected, got = weights(straight), weights(skipping)
    assert all(torch.allclose(expected[name], got[name], rtol=0, atol=1e-7) for name in expected)
