"""On the CPU, `deepspeed.optimizer: auto` (and `torch`) runs torch's fused AdamW: the same update as torch's
default AdamW loop, in one pass without that loop's two partition-sized temporaries (the first step's peak)."""

from __future__ import annotations

import torch

from astrai.config.schema import DeepSpeedSection
from astrai.engine import build_ds_config, make_engine, parameter_groups
from tests.unit.engine.tiny import tiny_llama


def test_cpu_engine_steps_with_fused_adamw_as_the_plain_loop(one_rank):
    torch.manual_seed(0)
    model = tiny_llama()
    reference = tiny_llama()
    reference.load_state_dict(model.state_dict())
    settings = dict(template_path=None, micro_batch_size=2, grad_accum_steps=1, max_grad_norm=None)
    config = build_ds_config(
        DeepSpeedSection(), **settings, precision="fp32", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, world_size=1
    )
    assert config["optimizer"]["params"]["fused"] is True
    engine = make_engine(model, config, weight_decay=0.1, schedule=lambda completed: 1.0)
    optimizer = engine._engine.basic_optimizer
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    plain = torch.optim.AdamW(parameter_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert not plain.defaults.get("fused")
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 50, (2, 8), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        plain.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        plain.step()
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
