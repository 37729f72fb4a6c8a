"""Weight decay groups of a model loaded partitioned (ZeRO-3 `zero3_init`), on a real one-rank group.

Under `deepspeed.zero.Init` every parameter is a flat local shard (ndim 1) whose shape lives in
`ds_shape`; grouping by `ndim` would put every matrix in the no-decay group (no weight decay at all,
and an optimizer with one group instead of two, which breaks loading a checkpoint's LR schedule).
"""

from __future__ import annotations

import deepspeed
from transformers import LlamaForCausalLM

from astrai.engine import parameter_groups
from tests.unit.engine.tiny import TINY_LLAMA


def test_partitioned_matrices_still_decay(one_rank):
    config = TINY_LLAMA
    plain = LlamaForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        partitioned = LlamaForCausalLM(config)
    assert all(parameter.ndim == 1 for parameter in partitioned.parameters())  # flat shards: ndim says nothing
    expected = [[tuple(p.shape) for p in group["params"]] for group in parameter_groups(plain, 0.1)]
    got = [[tuple(p.ds_shape) for p in group["params"]] for group in parameter_groups(partitioned, 0.1)]
    assert got == expected and all(len(shape) == 2 for shape in got[0]) and all(len(shape) == 1 for shape in got[1])
    assert [group["weight_decay"] for group in parameter_groups(partitioned, 0.1)] == [0.1, 0.0]
