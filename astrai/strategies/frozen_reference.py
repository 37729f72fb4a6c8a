"""The frozen reference model that `dpo`, `grpo` and `online_ppo` score against: built once, held in
eval mode without an optimizer, sharded like the policy. A LoRA policy (`model.lora`) is its own
reference: the same module with its adapter disabled, so no second model is held."""

from __future__ import annotations

import torch

from astrai.engine import FrozenEngine, make_frozen_engine, zero3_building
from astrai.export.weights import load_checkpoint_weights
from astrai.models.policy import build_policy
from astrai.models.segment_attention import use_segment_attention


def reference_is_the_policy(job) -> bool:
    """A LoRA policy without `model.reference_path` is its own reference (its adapter disabled): no second model
    is held. The planner counts the reference's memory from this same answer."""
    return job.model.lora is not None and job.model.reference_path is None


def reference_model(job, tokenizer, ds_config: dict) -> tuple[torch.nn.Module, str]:
    """The frozen reference's module (`model.reference_path`, else the policy's starting weights) and
    a line naming its source. Under ZeRO-3 with `model.zero3_init` a `path` loads partitioned and a `model.init`
    is built partitioned (with the policy's exact starting weights), as the policy is (astrai/training/build.py): a
    whole build first holds a full fp32 copy on every rank."""
    model_config = job.model
    if model_config.reference_path is not None:
        model_config = model_config.model_copy(update={"path": model_config.reference_path, "init": None})
    source = model_config.path or f"model.init (seed {job.train.seed}): the policy's starting weights"
    start = job.model.init_from_checkpoint if model_config.reference_path is None else None
    with zero3_building(ds_config, model_config.zero3_init and start is None, from_config=model_config.path is None):
        model = build_policy(model_config, tokenizer, job.train.seed)
    if start is not None:  # the policy's starting weights are that checkpoint's
        source = f"model.init_from_checkpoint {load_checkpoint_weights(model, start)}: the policy's starting weights"
    return model, source


class DisabledAdapterReference:
    """The LoRA policy's base model: the policy engine's forward with the adapter disabled, in eval mode and
    without gradient (under ZeRO-3 the same partitioned parameters, gathered by the same hooks)."""

    def __init__(self, policy):
        self.policy = policy

    @property
    def module(self) -> torch.nn.Module:
        return self.policy.module

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        module = self.policy.module
        was_training = module.training
        module.eval()  # as a FrozenEngine: no dropout in the base (the adapter's own is off with the adapter)
        try:
            with module.disable_adapter():
                return self.policy(*args, **kwargs)
        finally:
            module.train(was_training)


def build_reference(
    job, tokenizer, ds_config: dict, policy=None
) -> tuple[FrozenEngine | DisabledAdapterReference, str]:
    """The reference as a frozen engine sharded like the trainable `ds_config` (the policy's), and its source;
    for a LoRA `policy` engine without `model.reference_path`, the policy with its adapter disabled."""
    if policy is not None and reference_is_the_policy(job):
        return DisabledAdapterReference(policy), "the LoRA policy with its adapter disabled (its base model)"
    model, source = reference_model(job, tokenizer, ds_config)
    if job.data.packing or job.rl.packing:  # its packed forwards run sdpa one row at a time, as the policy's
        use_segment_attention(model)
    return make_frozen_engine(model, ds_config), source
