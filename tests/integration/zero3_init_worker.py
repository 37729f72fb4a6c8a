"""One gloo rank of test_zero3_init_ranks.py: `deepspeed --num_gpus 2 zero3_init_worker.py <results_dir>`.

For each case (a tied Qwen2, an untied Llama and a GPT-2 policy; the reference and the critic built from
the Qwen2 one), builds the model whole and then partitioned under ZeRO-3 (`model.zero3_init`, the
builders of astrai/training/build.py and strategies/frozen_reference.py),
each right after seeding as a run does, gathers the partitioned parameters and compares every one, and
every buffer, with the whole build's bit for bit; and the RNG state each build leaves. Writes
`<results_dir>/rank<R>.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from astrai.config import JobConfig
from astrai.engine import DistInfo, setup_distributed
from astrai.models.tokenizer import build_tokenizer, set_pad_token
from astrai.strategies.engine_settings import engine_config
from astrai.strategies.frozen_reference import reference_model
from astrai.training.build import build_critic_module, build_policy_model

CASES = {
    "qwen2_tied": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "llama_untied": {
        "model_type": "llama",
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4},  # Conv1D; c_proj's scaled init
}


def job_for(init: dict, stage: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "output_dir": "unused",
            "model": {"init": init},
            "tokenizer": {"build": {"kind": "char"}},
            "data": {"path": "unused.jsonl"},
            "train": {"train_type": "online_ppo", "micro_batch_size": 1, "seed": 7, "max_steps": 1},
            "reward": {"function": "astrai.rollout.rewards:arithmetic_exact_match"},
            "deepspeed": {"zero_stage": stage},
        }
    )


def gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters):
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return state


def compare(whole: dict, partitioned: dict) -> list[str]:
    problems = [f"names differ: {sorted(set(whole) ^ set(partitioned))}"] if whole.keys() != partitioned.keys() else []
    for name in sorted(whole.keys() & partitioned.keys()):
        a, b = whole[name], partitioned[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: {a.dtype}{list(a.shape)} whole, {b.dtype}{list(b.shape)} partitioned")
        elif not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):  # bit for bit
            problems.append(f"{name}: max |difference| {(a.double() - b.double()).abs().max().item()}")
    return problems


def build(kind: str, job: JobConfig, tokenizer, world_size: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(job.train.seed)  # build_run's seed_everything
    ds_config = engine_config(job, "worker", world_size=world_size)
    if kind == "policy":
        model = build_policy_model(job, ds_config, tokenizer)
    elif kind == "reference":
        model, _ = reference_model(job, tokenizer, ds_config)
    else:
        model = build_critic_module(job, ds_config, tokenizer)
    return model, torch.get_rng_state()


def main(results_dir: Path) -> None:
    os.environ.setdefault("ASTR_BACKEND", "eager")
    info: DistInfo = setup_distributed(120)
    tokenizer = build_tokenizer("char", ["0123456789+-=? abcdefghij"])
    set_pad_token(tokenizer, None)
    results = {}
    for name, init in CASES.items():
        for kind in ("policy", "reference", "critic") if name == "qwen2_tied" else ("policy",):
            whole, whole_rng = build(kind, job_for(init, 0), tokenizer, info.world_size)
            partitioned, partitioned_rng = build(kind, job_for(init, 3), tokenizer, info.world_size)
            local = [p.ds_tensor.numel() for p in partitioned.parameters() if hasattr(p, "ds_tensor")]
            results[f"{name}/{kind}"] = {
                "partitioned": len(local) == len(list(partitioned.parameters())),
                "local_numel": sum(local),
                "numel": sum(p.numel() for p in whole.parameters()),
                "problems": compare(whole.state_dict(), gathered_state(partitioned)),
                "same_rng": torch.equal(whole_rng, partitioned_rng),
            }
    (results_dir / f"rank{info.rank}.json").write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[-1]))  # the deepspeed launcher puts --local_rank first
