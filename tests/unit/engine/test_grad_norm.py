"""A real single-rank DeepSpeed engine in this process: ZeRO-0 reports the gradient norm it clips.

DeepSpeed's non-ZeRO path clips with torch's clip_grad_norm_ and drops the norm, so without our
Engine taking it the `grad_norm` metric of every 1-rank run (ZeRO-1/2 run as ZeRO-0 there) is null.
"""

from __future__ import annotations

import pytest
import torch

from astrai.config.schema import DeepSpeedSection
from astrai.engine import build_ds_config, make_engine
from tests.unit.engine.tiny import tiny_llama


@pytest.mark.parametrize("max_grad_norm", [1e-3, 100.0, None])  # None: no clipping, so DeepSpeed computes no norm
def test_zero0_reports_the_pre_clip_gradient_norm(one_rank, max_grad_norm):
    dist = one_rank
    assert dist.world_size == 1
    torch.manual_seed(0)
    model = tiny_llama()
    reference = tiny_llama()
    reference.load_state_dict(model.state_dict())
    config = build_ds_config(
        DeepSpeedSection(),
        template_path=None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=max_grad_norm,
        precision="fp32",
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        world_size=1,
    )
    engine = make_engine(model, config, weight_decay=0.0, schedule=lambda completed: 1.0)
    assert engine.zero_stage == 0 and engine.grad_norm is None
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    assert engine.grad_norm == pytest.approx(float(expected), rel=1e-5)
    if max_grad_norm == 1e-3:
        assert engine.grad_norm > max_grad_norm  # the norm before clipping, not after
        # ... and the update was clipped: AdamW's first step moves by ~lr whatever the scale, so compare
        # the clip through the optimizer's first moment, (1 - beta1) x the clipped gradient.
        moments = [engine._engine.optimizer.state[p]["exp_avg"] for p in engine.module.parameters()]
        assert float(torch.nn.utils.get_total_norm(moments)) == pytest.approx(0.1 * max_grad_norm, rel=1e-3)
