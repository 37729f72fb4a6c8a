"""`dpo`'s frozen reference on a real one-rank DeepSpeed group in this process: built by build_run,
loaded partitioned under ZeRO-3 as the policy is (`model.zero3_init` with a `model.path`), evaluated
only (no gradients, eval mode, no optimizer), with the weights of `model.reference_path` when given.

One rank cannot show a shard of half the parameters; what it shows is that the reference module is
already made of ZeRO partitions when it is built, i.e. no full plain copy is ever materialised first.
"""

from __future__ import annotations

import pytest
import torch

from astrai.config import load_job
from astrai.engine import FrozenEngine
from astrai.models.policy import load_causal_lm
from astrai.strategies.frozen_reference import reference_model
from astrai.training.build import build_run
from tests.unit.strategies.dpo_fixtures import preference_folder

JOB = """\
output_dir: {output_dir}
model: {{path: {model}}}
data: {{path: {data}, max_seq_len: 32}}
train: {{train_type: dpo, max_steps: 1, micro_batch_size: 2, lr: 1e-3, lr_schedule: constant, warmup_steps: 0, seed: 3}}
deepspeed: {{zero_stage: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """pairs.jsonl (8 shipped pairs) and two tiny HF models sharing one char tokenizer: `start` (the
    policy's starting weights) and `other` (a reference that differs from them)."""
    return preference_folder(tmp_path_factory.mktemp("dpo_reference"), 8, {"start": 0, "other": 1})


def make_run(dist, folder, name, *overrides):
    config = folder / f"{name}.yaml"
    config.write_text(JOB.format(output_dir=folder / name, model=folder / "start", data=folder / "pairs.jsonl"))
    return build_run(load_job(config, list(overrides)), dist, str(config))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_reference_is_frozen_and_partitioned_under_zero3(one_rank, folder):
    run = make_run(one_rank, folder, "default")
    reference, policy = run.strategy.reference, run.engines["policy"]
    assert isinstance(reference, FrozenEngine) and policy.zero_stage == 3
    engine = (
        reference._engine
    )  # no optimizer (ZeRO-3's `optimizer` slot holds only its parameter fetcher) and no schedule
    assert (
        engine.basic_optimizer is None
        and engine.lr_scheduler is None
        and not isinstance(engine.optimizer, torch.optim.Optimizer)
    )
    assert engine.zero_optimization_stage() == 3
    assert not any(module.training for module in reference.module.modules())
    parameters = list(reference.module.parameters())
    assert parameters and not any(p.requires_grad for p in parameters)
    plain = load_causal_lm(folder / "start")
    assert all(hasattr(p, "ds_tensor") for p in parameters)  # ZeRO-3 partitions, not plain tensors
    assert sum(p.ds_numel for p in parameters) == sum(p.numel() for p in plain.parameters())
    # Partitioned loading must still load the weights: the reference computes what the folder's model does.
    ids = torch.tensor([run.dataset[0]["chosen_ids"]])
    assert torch.allclose(logits(reference, ids), logits(plain, ids), atol=1e-5)
    assert run.strategy.checkpoint_meta()["reference"] == str(folder / "start")


def test_reference_module_is_built_partitioned(one_rank, folder):
    """Before any engine wraps it: under ZeRO-3 the module is born partitioned (no local full copy);
    with `model.zero3_init=false` (or ZeRO-2) it is a plain module."""
    run = make_run(one_rank, folder, "built")
    ds_config = run.engines["policy"].ds_config
    model, _ = reference_model(run.job, run.tokenizer, ds_config)
    assert all(hasattr(p, "ds_id") and p.data.numel() == 0 for p in model.parameters())
    plain, _ = reference_model(
        run.job.model_copy(update={"model": run.job.model.model_copy(update={"zero3_init": False})}),
        run.tokenizer,
        ds_config,
    )
    assert not any(hasattr(p, "ds_id") for p in plain.parameters())
    stage2 = {**ds_config, "zero_optimization": {**ds_config["zero_optimization"], "stage": 2}}
    assert not any(hasattr(p, "ds_id") for p in reference_model(run.job, run.tokenizer, stage2)[0].parameters())


def test_reference_path_loads_another_model(one_rank, folder):
    run = make_run(one_rank, folder, "other", f"model.reference_path={folder / 'other'}")
    ids = torch.tensor([run.dataset[0]["chosen_ids"]])
    expected, start = logits(load_causal_lm(folder / "other"), ids), logits(load_causal_lm(folder / "start"), ids)
    assert torch.allclose(logits(run.strategy.reference, ids), expected, atol=1e-5)
    assert not torch.allclose(expected, start, atol=1e-2)  # the two models differ, so the check above means something
    assert torch.allclose(
        logits(run.engines["policy"].module, ids), start, atol=1e-5
    )  # the policy still starts from model.path
    assert run.strategy.checkpoint_meta()["reference"] == str(folder / "other")
