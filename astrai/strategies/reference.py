"""The frozen reference model that `dpo`, `grpo` and `online_ppo` score against: built once, held in
eval mode without an optimizer, sharded like the policy."""

from __future__ import annotations

import torch

from astrai.engine import FrozenEngine, make_frozen_engine, zero3_loading
from astrai.init_from_checkpoint import load_checkpoint_weights
from astrai.models.policy import build_policy
from astrai.models.segment_attention import use_segment_attention


def reference_model(job, tokenizer, ds_config: dict) -> tuple[torch.nn.Module, str]:
    """The frozen reference's module (`model.reference_path`, else the policy's starting weights) and
    a line naming its source. Under ZeRO-3 with `model.zero3_init` a `path` loads partitioned, as the
    policy does (astrai/build.py): a plain load first holds a full fp32 copy on every rank."""
    model_config = job.model
    if model_config.reference_path is not None:
        model_config = model_config.model_copy(update={"path": model_config.reference_path, "init": None})
    source = model_config.path or f"model.init (seed {job.train.seed}): the policy's starting weights"
    start = job.model.init_from_checkpoint if model_config.reference_path is None else None
    with zero3_loading(ds_config, model_config.zero3_init and model_config.path is not None and start is None):
        model = build_policy(model_config, tokenizer, job.train.seed)
    if start is not None:  # the policy's starting weights are that checkpoint's
        source = f"model.init_from_checkpoint {load_checkpoint_weights(model, start)}: the policy's starting weights"
    return model, source


def build_reference(job, tokenizer, ds_config: dict) -> tuple[FrozenEngine, str]:
    """The reference as a frozen engine sharded like the trainable `ds_config` (the policy's), and its source."""
    model, source = reference_model(job, tokenizer, ds_config)
    if job.data.packing or job.rl.packing:  # its packed forwards run sdpa one row at a time, as the policy's
        use_segment_attention(model)
    return make_frozen_engine(model, ds_config), source
