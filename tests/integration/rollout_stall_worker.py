"""One gloo rank of test_rollout_stall.py: `python rollout_stall_worker.py <results_dir>`.

Both ranks build the same tiny Llama in a ZeRO-3 engine with a 4 s job timeout (runtime.dist_timeout_s).
Rank 1 then stalls (as a rank stuck in a slow reward or a dead node would) while rank 0 samples: its
rollout weight sync must fail within the timeout, naming the operation and the rank, instead of
waiting for torch's 30-minute default. Each rank writes rank<R>.json and leaves with os._exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.config.schema import DeepSpeedSection
from astrai.engine import CollectiveStalledError, build_ds_config, make_engine, setup_distributed


def main() -> None:
    results = Path(sys.argv[1])
    info = setup_distributed(4)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    )
    config = build_ds_config(
        DeepSpeedSection(zero_stage=3),
        template_path=None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=1.0,
        precision="fp32",
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        world_size=info.world_size,
    )
    engine = make_engine(model, config, weight_decay=0.0, schedule=lambda _: 1.0)
    outcome: dict = {}
    with engine.generation_module() as copy:  # both ranks: one full sync works
        outcome["synced_parameters"] = sum(parameter.numel() for parameter in copy.parameters())
    if info.rank == 1:
        (results / "rank1.json").write_text(json.dumps(outcome))
        time.sleep(60)  # stalled: never joins the next sync
        os._exit(0)
    started = time.perf_counter()
    try:
        with engine.generation_module():
            outcome["error"] = None
    except CollectiveStalledError as error:
        outcome["error"] = str(error)
    outcome["seconds"] = time.perf_counter() - started
    (results / "rank0.json").write_text(json.dumps(outcome))
    os._exit(0)


if __name__ == "__main__":
    main()
