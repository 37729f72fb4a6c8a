"""ZeRO bucket sizes derived from the model's hidden size (engine/buckets.py), a user's numbers kept, and the
same numbers in the memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astrai.config import load_job
from astrai.engine.buckets import DEEPSPEED_DEFAULTS
from astrai.engine.ds_config import check_ds_config
from astrai.launch.memory_plan import make_plan
from astrai.strategies.engine_settings import engine_config
from tests.conftest import REPO

HIDDEN = 64
TINY_INIT = {
    "model_type": "qwen2",
    "vocab_size": 96,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def job_file(folder: Path, deepspeed: dict, init: dict | None = None) -> Path:
    job = {
        "output_dir": str(folder / "run"),
        "model": {"init": init or TINY_INIT, "dtype": "fp32"},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": str(REPO / "data/arithmetic/sft.jsonl"), "max_seq_len": 16},
        "train": {"train_type": "sft", "micro_batch_size": 2, "max_steps": 1},
        "deepspeed": deepspeed,
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))
    return path


def resolved(path: Path, world_size: int = 2) -> dict:
    config = engine_config(load_job(path), str(path), world_size=world_size)
    check_ds_config(config, "test")  # what DeepSpeed would accept
    return config["zero_optimization"]


def test_zero3_buckets_follow_the_hidden_size(tmp_path):
    zero = resolved(job_file(tmp_path, {"config": "ds_configs/zero3.json"}))
    assert zero["reduce_bucket_size"] == HIDDEN**2
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN**2)
    assert zero["stage3_param_persistence_threshold"] == 10 * HIDDEN
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 100_000_000
    assert "allgather_bucket_size" not in zero  # ZeRO-3 gathers by the prefetch bucket


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_buckets_follow_the_hidden_size(tmp_path, stage):
    zero = resolved(job_file(tmp_path, {"config": f"ds_configs/zero{stage}.json"}))
    assert zero["stage"] == stage
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == HIDDEN**2
    assert not any(key.startswith("stage3_") for key in zero)


def test_gpt2_width_is_read_through_its_own_field_name(tmp_path):
    init = {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 96}
    zero = resolved(job_file(tmp_path, {"zero_stage": 2}, init))
    assert zero["reduce_bucket_size"] == 48 * 48


def test_a_number_the_user_sets_wins_and_auto_is_derived(tmp_path):
    template = tmp_path / "mine.json"
    template.write_text(
        json.dumps(
            {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1234, "stage3_max_live_parameters": "auto"}}
        )
    )
    overrides = {"zero_optimization": {"stage3_prefetch_bucket_size": 777, "stage3_max_reuse_distance": "auto"}}
    zero = resolved(job_file(tmp_path, {"config": str(template), "overrides": overrides}))
    assert zero["reduce_bucket_size"] == 1234  # the template's number
    assert zero["stage3_prefetch_bucket_size"] == 777  # the job's override
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 100_000_000  # auto: derived
    assert zero["stage3_param_persistence_threshold"] == 10 * HIDDEN  # left out: derived


def test_auto_without_a_hidden_size_falls_back_to_deepspeeds_defaults(tmp_path):
    from astrai.config.schema import DeepSpeedSection
    from astrai.engine import build_ds_config

    section = DeepSpeedSection(zero_stage=2, overrides={"zero_optimization": {"reduce_bucket_size": "auto"}})
    config = build_ds_config(
        section, template_path=None, micro_batch_size=1, grad_accum_steps=1, max_grad_norm=1.0,
        precision="fp32", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, hidden_size=None,
    )  # fmt: skip
    assert config["zero_optimization"]["reduce_bucket_size"] == DEEPSPEED_DEFAULTS["reduce_bucket_size"]
    assert "allgather_bucket_size" not in config["zero_optimization"]  # left to DeepSpeed itself
    check_ds_config(config, "test")


def test_the_plan_counts_the_derived_buckets(tmp_path):
    path = job_file(tmp_path, {"zero_stage": 3})
    plan = make_plan(load_job(path), str(path), 2, None, host_memory=10**12)
    buckets = {row.component: row.host for row in plan.rows}["policy ZeRO-3 buckets"]
    parameters = plan.policy_parameters
    # two reduce buckets (the bucket and DeepSpeed's flat copy of it) + the prefetch bucket, fp32
    expected = 2 * min(parameters, HIDDEN**2) + min(parameters, int(0.9 * HIDDEN**2))
    assert buckets == expected * 4


def test_the_plan_counts_one_chunk_of_logits(tmp_path):
    path = job_file(tmp_path, {"zero_stage": 0})  # 2 sequences x 16 positions, vocab of the char tokenizer
    rows = {}
    for chunk in (0, 8):
        job = load_job(path, [f"train.logits_chunk_size={chunk}"])
        plan = make_plan(job, str(path), 1, None, host_memory=10**12)
        rows[chunk] = {row.component: row.host for row in plan.rows}["logits + log-softmax"]
    assert rows[8] * 32 == rows[0] * 8  # 8 of the 32 positions at a time


def test_a_templates_auto_keys_of_another_stage_are_derived_too(tmp_path):
    # zero3.json's stage-3 keys say "auto"; the job runs it as ZeRO-2: every auto is still a number
    zero = resolved(job_file(tmp_path, {"config": "ds_configs/zero3.json", "zero_stage": 2}))
    assert zero["stage"] == 2 and zero["allgather_bucket_size"] == HIDDEN**2
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN**2)
    assert "auto" not in zero.values()
