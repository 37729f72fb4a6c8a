"""Weight decay groups of a model loaded partitioned (ZeRO-3 `zero3_init`), on a real one-rank group.

Under `deepspeed.zero.Init` every parameter is a flat local shard (ndim 1) whose shape lives in
`ds_shape`; grouping by `ndim` would put every matrix in the no-decay group (no weight decay at all,
and an optimizer with one group instead of two, which breaks loading a checkpoint's LR schedule).
"""

from __future__ import annotations

import deepspeed
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.engine import parameter_groups


def test_partitioned_matrices_still_decay(one_rank):
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    plain = LlamaForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        partitioned = LlamaForCausalLM(config)
    assert all(parameter.ndim == 1 for parameter in partitioned.parameters())  # flat shards: ndim says nothing
    expected = [[tuple(p.shape) for p in group["params"]] for group in parameter_groups(plain, 0.1)]
    got = [[tuple(p.ds_shape) for p in group["params"]] for group in parameter_groups(partitioned, 0.1)]
    assert got == expected and all(len(shape) == 2 for shape in got[0]) and all(len(shape) == 1 for shape in got[1])
    assert [group["weight_decay"] for group in parameter_groups(partitioned, 0.1)] == [0.1, 0.0]
