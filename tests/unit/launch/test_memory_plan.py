"""`python -m astrai plan`: the bytes per rank by hand, the parameter count against built models, the
checkpoint size against a real DeepSpeed save, and a bad job refused as train.py refuses it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from astrai.config import load_job
from astrai.config.schema import DeepSpeedSection
from astrai.engine import build_ds_config, make_engine
from astrai.launch.memory_plan import (
    RUNTIME_BASELINE_BYTES,
    ModelShape,
    activation_bytes,
    checkpoint_bytes,
    count_shapes,
    engine_rows,
    make_plan,
    plan_main,
)
from astrai.models.value import ValueModel, trunk_of

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from conftest import child_env, run_bounded  # noqa: E402

# vocab 40, hidden 8, 2 layers, 2 heads (1 kv head of 4), mlp 16, tied: embed 320; per layer
# q 64 + k 32 + v 32 + o 64 + mlp 3 x 128 + 2 norms x 8 = 592; final norm 8 -> 320 + 2 x 592 + 8 = 1512
TINY_INIT = {
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
TINY_PARAMETERS = 1512


def zero_config(stage: int, **zero) -> dict:
    return {"zero_optimization": {"stage": stage, **zero}}


def by_name(rows) -> dict[str, tuple[int, int]]:
    return {row.component: (row.gpu, row.host) for row in rows}


def test_bytes_per_rank_follow_precision_stage_and_offload():
    # bf16, ZeRO-2 over 4 ranks: params 2 B whole, grads 2 B / 4, master 4 B / 4, moments 8 B / 4,
    # buckets: reduce + allgather, each min(P, size) x 2 B.
    config = zero_config(2, reduce_bucket_size=300, allgather_bucket_size=5000)
    rows = by_name(engine_rows("policy", 1000, config, "bf16", 4))
    assert rows == {
        "policy parameters": (2000, 0),
        "policy gradients": (500, 0),
        "policy fp32 master weights": (1000, 0),
        "policy Adam moments": (2000, 0),
        "policy ZeRO-2 buckets": (300 * 2 + 1000 * 2, 0),
    }
    # fp32 ZeRO-0: no master copy (the optimizer steps the module's own weights), nothing partitioned.
    rows = by_name(engine_rows("policy", 1000, zero_config(0), "fp32", 4))
    assert rows == {
        "policy parameters": (4000, 0),
        "policy gradients": (4000, 0),
        "policy fp32 master weights": (0, 0),
        "policy Adam moments": (8000, 0),
        "policy ZeRO-0 buckets": (0, 0),
    }
    # fp32 ZeRO-3 over 2 ranks with both offloads: parameters, master and moments in host memory.
    config = zero_config(
        3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}, stage3_prefetch_bucket_size=100
    )
    rows = by_name(engine_rows("critic", 1000, config, "fp32", 2))
    assert rows == {
        "critic parameters": (0, 2000),
        "critic gradients": (2000, 0),
        "critic fp32 master weights": (0, 2000),
        "critic Adam moments": (0, 4000),
        "critic ZeRO-3 buckets": (2 * 1000 * 4 + 100 * 4, 0),
    }


def test_activation_and_checkpoint_arithmetic():
    shape = ModelShape(parameters=0, layers=3, hidden=64, heads=4, vocab=0)
    # per layer s b h (34 + 5 a s / h) in 16-bit units: 32 x 2 x 64 x (34 + 5 x 4 x 32 / 64) = 4096 x 44
    assert activation_bytes(shape, 2, 32, "bf16", False) == 3 * 4096 * 44
    assert activation_bytes(shape, 2, 32, "fp32", False) == 3 * 4096 * 44 * 2
    # with checkpointing: every layer's input + one layer recomputed in full
    assert activation_bytes(shape, 2, 32, "bf16", True) == 3 * 2 * 4096 + 4096 * 44
    assert checkpoint_bytes(100, 0, "fp32") == 100 * 12  # module (the master) + m + v
    assert checkpoint_bytes(100, 2, "fp32") == 100 * 16  # module + fp32 partitions + m + v
    assert checkpoint_bytes(100, 2, "bf16") == 100 * 14
    assert checkpoint_bytes(100, 3, "bf16") == 100 * 12


def write_job(folder: Path, **extra) -> Path:
    job = {
        "output_dir": str(folder / "run"),
        "model": {"init": TINY_INIT, "dtype": "fp32"},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": str(REPO / "data/arithmetic/sft.jsonl"), "max_seq_len": 16},
        "train": {"train_type": "sft", "micro_batch_size": 2, "max_steps": 1},
        "deepspeed": {"zero_stage": 0},
        **extra,
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(job))
    return path


def test_a_tiny_job_is_planned_to_the_byte(tmp_path):
    config = write_job(tmp_path)
    plan = make_plan(load_job(config), str(config), 1, None, host_memory=10**12)
    p = TINY_PARAMETERS
    # activations: 2 layers x 16 x 2 x 8 x (34 + 5 x 2 x 16 / 8) x 4/2 = 2 x 256 x 54 x 2; logits 2 x 16 x 40 x 8
    expected = {
        "policy parameters": 4 * p,
        "policy gradients": 4 * p,
        "policy fp32 master weights": 0,
        "policy Adam moments": 8 * p,
        "policy ZeRO-0 buckets": 0,
        "activations": 2 * 256 * 54 * 2,
        "logits + log-softmax": 2 * 16 * 40 * 8,
        "runtime baseline": RUNTIME_BASELINE_BYTES,
    }
    assert by_name(plan.rows) == {name: (0, value) for name, value in expected.items()}  # no GPU here: all host
    assert plan.host_total == sum(expected.values()) and plan.checkpoint_bytes == 12 * p and plan.fits
    assert not make_plan(load_job(config), str(config), 1, None, host_memory=plan.host_total - 1).fits


def test_a_packed_job_plans_one_row_of_the_token_budget(tmp_path):
    """data.packing: a micro-batch is one row of train.micro_batch_tokens, as a padded micro-batch of one
    row that long."""
    config = write_job(tmp_path)
    rows = {}
    for name, overrides in (
        ("packed", ["data.packing=true", "train.micro_batch_tokens=32"]),
        ("one_row", ["train.micro_batch_size=1", "data.max_seq_len=32"]),
    ):
        rows[name] = by_name(make_plan(load_job(config, overrides), str(config), 1, None, 10**12).rows)
    assert rows["packed"] == rows["one_row"]
    assert rows["packed"]["logits + log-softmax"] == (0, 32 * 40 * 8)


def test_online_ppo_adds_reference_critic_and_generation_copy(tmp_path):
    config = write_job(
        tmp_path,
        model={"init": TINY_INIT},  # dtype auto: bf16 when planned for GPUs
        train={"train_type": "online_ppo", "micro_batch_size": 2, "max_steps": 1},
        data={"path": str(REPO / "data/arithmetic/prompts_64.jsonl"), "max_seq_len": 16},
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        rl={"kl_coef": 0.1},
        reward={"function": "astrai.rollout.rewards:arithmetic_exact_match"},
        deepspeed={"zero_stage": 3},
        critic={"zero_stage": 0},
    )
    plan = make_plan(load_job(config), str(config), 2, 40.0, host_memory=10**12)
    rows = by_name(plan.rows)
    critic = count_shapes(AutoConfig.for_model(**TINY_INIT), critic=True).parameters
    assert plan.precision == "bf16" and plan.zero_stage == 3
    assert rows["reference parameters"] == (TINY_PARAMETERS * 2 // 2, 0)  # ZeRO-3: partitioned over 2 ranks
    assert rows["ZeRO-3 generation copy"] == (TINY_PARAMETERS * 2, 0)  # one whole bf16 copy
    assert rows["critic parameters"] == (critic * 2, 0) and rows["critic Adam moments"] == (critic * 8, 0)  # ZeRO-0
    # (16 + 8) tokens per sequence, 2 sequences: logits 2 x 24 x 40 x 8
    assert rows["logits + log-softmax"] == (2 * 24 * 40 * 8, 0)
    assert plan.checkpoint_bytes == checkpoint_bytes(TINY_PARAMETERS, 3, "bf16") + checkpoint_bytes(critic, 0, "bf16")


def test_rl_packing_plans_one_row_of_the_token_budget(tmp_path):
    """rl.packing: a grpo micro-batch is cut by train.micro_batch_tokens, planned as one row that long."""
    config = write_job(
        tmp_path,
        train={"train_type": "grpo", "micro_batch_size": 2, "max_steps": 1, "micro_batch_tokens": 48},
        data={"path": str(REPO / "data/arithmetic/prompts_64.jsonl"), "max_seq_len": 16},
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        reward={"function": "astrai.rollout.rewards:arithmetic_exact_match"},
    )
    padded = by_name(make_plan(load_job(config), str(config), 1, None, 10**12).rows)
    packed = by_name(make_plan(load_job(config, ["rl.packing=true"]), str(config), 1, None, 10**12).rows)
    assert padded["logits + log-softmax"] == (0, 2 * 24 * 40 * 8)  # 2 sequences of 16 + 8 tokens
    assert packed["logits + log-softmax"] == (0, 48 * 40 * 8)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_a_built_model(tied):
    config = AutoConfig.for_model(**{**TINY_INIT, "tie_word_embeddings": tied})
    built = AutoModelForCausalLM.from_config(config)
    built_count = sum(p.numel() for p in built.parameters())
    assert count_shapes(config).parameters == built_count == TINY_PARAMETERS + (0 if tied else 320)
    critic = ValueModel(trunk_of(AutoModelForCausalLM.from_config(config)))
    assert count_shapes(config, critic=True).parameters == sum(p.numel() for p in critic.parameters())


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_size_matches_a_real_save(one_rank, tmp_path, stage):
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY_INIT, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 300})
    model = AutoModelForCausalLM.from_config(config)
    section = DeepSpeedSection(zero_stage=stage, single_rank_stage0=False)  # ZeRO-2 kept on one rank
    ds_config = build_ds_config(
        section,
        template_path=None,
        micro_batch_size=2,
        grad_accum_steps=1,
        max_grad_norm=None,
        precision="fp32",
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    engine = make_engine(model, ds_config, weight_decay=0.0, schedule=lambda completed: 1.0)
    ids = torch.randint(0, 300, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # torch's Adam creates its moments at the first step
    engine.save(tmp_path / "checkpoint")
    on_disk = sum(path.stat().st_size for path in (tmp_path / "checkpoint").rglob("*") if path.is_file())
    planned = checkpoint_bytes(count_shapes(config).parameters, stage, "fp32")
    assert planned == pytest.approx(on_disk, rel=0.03)  # the rest: pickle headers, names, the step counters


def test_the_cli_prints_a_table_and_json(tmp_path, capsys):
    config = write_job(tmp_path)
    assert plan_main(["--config", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy_parameters"] == TINY_PARAMETERS
    assert data["host_total"] == sum(row["host"] for row in data["rows"])
    assert plan_main(["--config", str(config), "--gpus-per-node", "2", "--gpu-memory-gib", "80"]) == 0
    table = capsys.readouterr().out
    assert "policy Adam moments" in table and "fits: yes" in table and "2 rank(s)" in table


def test_a_bad_job_fails_as_train_py_does(tmp_path, capsys):
    config = write_job(tmp_path, train={"train_type": "sft", "micro_batch_size": 0})
    assert plan_main(["--config", str(config)]) == 2
    planned = capsys.readouterr().err.strip()
    trained = run_bounded([sys.executable, "astrai/train.py", "--config", str(config)], 120, cwd=REPO, env=child_env())
    assert trained.returncode == 2 and planned.startswith("astrai: invalid job config")
    assert "job.yaml:1: train.micro_batch_size: Input should be greater than or equal to 1" in planned
    assert planned in trained.stderr  # the same message, word for word


@pytest.mark.parametrize(
    "option, value, kind",
    [
        ("--nodes", "0", "int"),
        ("--nodes", "-1", "int"),
        ("--gpus-per-node", "0", "int"),
        ("--gpus-per-node", "two", "int"),
        ("--gpu-memory-gib", "0", "float"),
        ("--gpu-memory-gib", "nan", "float"),
        ("--gpu-memory-gib", "inf", "float"),
    ],
)
def test_a_size_that_is_not_positive_is_refused_in_one_line(tmp_path, capsys, option, value, kind):
    """`--nodes 0` was a ZeroDivisionError deep in the plan; argparse refuses it now, naming the option."""
    config = write_job(tmp_path)
    with pytest.raises(SystemExit) as raised:
        plan_main(["--config", str(config), option, value])
    assert raised.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"python -m astrai plan: error: argument {option}: expected a positive {kind}, got {value!r}"]


def test_lora_plans_optimizer_state_for_the_adapter_and_no_reference(tmp_path):
    """online_ppo with model.lora and critic.lora: gradients, master weights and moments scale with the adapters
    (the critic's value head included), the policy is its own reference and samples in place under ZeRO-3."""
    config = write_job(
        tmp_path,
        model={"init": TINY_INIT, "lora": {"r": 2}},
        train={"train_type": "online_ppo", "micro_batch_size": 2, "max_steps": 1},
        data={"path": str(REPO / "data/arithmetic/prompts_64.jsonl"), "max_seq_len": 16},
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        rl={"kl_coef": 0.1},
        reward={"function": "astrai.rollout.rewards:arithmetic_exact_match"},
        deepspeed={"zero_stage": 3},
        critic={"zero_stage": 0, "lora": {"r": 2}},
    )
    plan = make_plan(load_job(config), str(config), 2, 40.0, host_memory=10**12)
    rows = by_name(plan.rows)
    policy = count_shapes(AutoConfig.for_model(**TINY_INIT), lora=load_job(config).model.lora)
    assert 0 < policy.trainable < policy.parameters / 2  # a tiny model: hidden 8, r 2
    assert rows["policy Adam moments"] == (policy.trainable * 8 // 2, 0)  # ZeRO-3 over 2 ranks
    assert rows["policy parameters"] == (policy.parameters * 2 // 2, 0)  # the frozen base is still held
    assert "reference parameters" not in rows and "ZeRO-3 generation copy" not in rows
    critic = count_shapes(AutoConfig.for_model(**TINY_INIT), critic=True, lora=load_job(config).critic.lora)
    hidden = TINY_INIT["hidden_size"]
    assert rows["critic Adam moments"] == (critic.trainable * 8, 0) and critic.trainable > hidden + 1  # head trains
