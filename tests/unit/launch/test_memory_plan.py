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
    GIB,
    RUNTIME_BASELINE_BYTES,
    ModelShape,
    SequenceLayout,
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
    shape = ModelShape(parameters=0, layers=3, hidden=64, heads=4, vocab=0, intermediate=128, kv_heads=2)
    # By hand, bf16 (w = 2), b = 2 sequences of s = 32, h 64, i 128, a 4 heads of d 16, g 2 kv heads, per layer:
    # outside attention T (4h + a d + 4i) = 64 x (256 + 64 + 512) = 53,248 elements -> 106,496 bytes
    # sdpa: q, out, k, v  b s d (2a + 2g) = 64 x 16 x 12 = 12,288 elements -> 24,576 bytes; logsumexp 64 x 4 x 4 = 1,024
    # -> 132,096 bytes a layer, 396,288 for 3
    layer = 106_496 + 24_576 + 1_024
    assert activation_bytes(shape, SequenceLayout(2, 32), "bf16") == (3 * layer, 0)
    # checkpointing: every layer's input (T h w = 8,192 bytes) + one layer recomputed in full; offload: inputs on host
    assert activation_bytes(shape, SequenceLayout(2, 32, checkpointing=True), "bf16") == (3 * 8_192 + layer, 0)
    assert activation_bytes(shape, SequenceLayout(2, 32, checkpointing="offload"), "bf16") == (layer, 3 * 8_192)
    # eager: q and k, v repeated to 4 heads (64 x 16 x 12 x 2) + scores b s^2 a x (4 fp32 softmax + 2 probabilities)
    eager = 106_496 + 24_576 + 64 * 32 * 4 * 6
    assert activation_bytes(shape, SequenceLayout(2, 32, attention="eager"), "bf16") == (3 * eager, 0)
    # sp = 2: 32 tokens a rank outside attention; inside, the full 64 with 2 heads and 1 kv head: half of it all
    assert activation_bytes(shape, SequenceLayout(2, 32, sequence_parallel=2), "bf16") == (3 * layer // 2, 0)
    # tiled MLP, one row of 256: the MLP's [T, i] x 4 go (256 x 512 x 2 bytes a layer), one tile stays:
    # ceil(256 / 64) = 4 shards of 64 tokens -> 64 x 512 x 2 bytes once
    whole = activation_bytes(shape, SequenceLayout(1, 256), "bf16")[0]
    tiled = activation_bytes(shape, SequenceLayout(1, 256, tiled_mlp=True), "bf16")[0]
    assert whole - tiled == 3 * 256 * 512 * 2 - 64 * 512 * 2
    assert checkpoint_bytes(100, 0, "fp32") == 100 * 12  # module (the master) + m + v
    assert checkpoint_bytes(100, 2, "fp32") == 100 * 16  # module + fp32 partitions + m + v
    assert checkpoint_bytes(100, 2, "bf16") == 100 * 14
    assert checkpoint_bytes(100, 3, "bf16") == 100 * 12


# Qwen2.5-0.5B's shape (configs/scale_0p5b.yaml)
QWEN_SHAPE = ModelShape(494_032_768, 24, 896, 14, 151_936, intermediate=4864, kv_heads=2)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sdpa_is_linear_in_the_length_and_eager_quadratic(checkpointing):
    def activations(attention: str, length: int) -> int:
        layout = SequenceLayout(1, length, attention, checkpointing=checkpointing)
        return activation_bytes(QWEN_SHAPE, layout, "bf16")[0]

    for attention in ("sdpa", "flash_attention_2", "flex_attention"):
        assert activations(attention, 16_384) / activations(attention, 8_192) == pytest.approx(2, rel=0.02)
    assert activations("eager", 16_384) / activations("eager", 8_192) > 3.5  # the s^2 scores dominate


def test_sequence_parallelism_divides_a_long_sequence_over_its_ranks():
    def activations(sp: int, length: int = 65_536) -> int:
        layout = SequenceLayout(1, length, sequence_parallel=sp, checkpointing=True)
        return activation_bytes(QWEN_SHAPE, layout, "bf16")[0]

    assert activations(2) == pytest.approx(activations(1) / 2, rel=0.01)
    # sp 7 > 2 kv heads: each rank still holds one kv head of the full length (DeepSpeed replicates them)
    assert activations(1) / 7 < activations(7) < activations(1) / 6


def test_tiled_mlp_keeps_one_tile_of_the_intermediates():
    whole = activation_bytes(QWEN_SHAPE, SequenceLayout(1, 65_536), "bf16")[0]
    tiled = activation_bytes(QWEN_SHAPE, SequenceLayout(1, 65_536, tiled_mlp=True), "bf16")[0]
    # 24 layers' [65,536, 4,864] x 4 go; ceil(65,536 / 896) = 74 shards: one tile of 886 tokens stays
    assert whole - tiled == 24 * 65_536 * 4 * 4864 * 2 - 886 * 4 * 4864 * 2


def test_a_32k_sequence_of_qwen_0p5b_under_sdpa_takes_a_few_gib():
    """configs/scale_0p5b.yaml at 32k tokens: Korthikanti's 5 a s^2 b term made it ~71 GiB of activations
    on one rank; sdpa keeps none of the scores."""
    config = REPO / "configs/scale_0p5b.yaml"
    overrides = ["data.max_seq_len=32768", "train.micro_batch_size=1"]
    plans = {
        attention: make_plan(
            load_job(config, [*overrides, f"model.attn_implementation={attention}"]), str(config), 8, 80.0
        )
        for attention in ("sdpa", "eager")
    }
    activations = {attention: by_name(plan.rows)["activations"][0] / GIB for attention, plan in plans.items()}
    assert activations["sdpa"] < 4 and plans["sdpa"].fits
    assert activations["eager"] > 30 and plans["eager"].layout.attention == "eager"


def test_checkpointing_offload_holds_the_layer_inputs_in_host_memory(tmp_path):
    config = write_job(tmp_path, model={"init": TINY_INIT, "dtype": "bf16", "gradient_checkpointing": True})
    job = load_job(config)
    offload = job.model_copy(update={"model": job.model.model_copy(update={"gradient_checkpointing": "offload"})})
    on_gpu = by_name(make_plan(job, str(config), 1, 40.0, host_memory=10**12).rows)["activations"]
    offloaded = by_name(make_plan(offload, str(config), 1, 40.0, host_memory=10**12).rows)["activations"]
    inputs = 2 * 32 * 8 * 2  # layers x tokens x hidden x 2 bytes
    assert on_gpu == (offloaded[0] + inputs, 0) and offloaded[1] == inputs


def test_max_seq_len_is_the_boundary_of_what_fits(tmp_path, capsys):
    config = write_job(tmp_path)
    argv = ["--config", str(config), "--gpus-per-node", "2", "--gpu-memory-gib", "0.01", "--max-seq-len", "--json"]
    assert plan_main([*argv, "--set", "parallel.sequence_parallel_size=2"]) == 0
    answer = json.loads(capsys.readouterr().out)["max_seq_len"]
    tokens = answer["tokens"]
    assert tokens > 16 and tokens % 2 == 0 and answer["limited_by"] == "activations" and answer["memory"] == "GPU"
    assert answer["line"].startswith(f"longest sequence that fits 0.01 GiB per rank: {tokens:,} tokens (sp=2, sdpa")

    def fits(length: int) -> bool:
        overrides = ["parallel.sequence_parallel_size=2", f"data.max_seq_len={length}"]
        return make_plan(load_job(config, overrides), str(config), 2, 0.01).fits

    assert fits(tokens) and not fits(tokens + 2)
    assert plan_main(argv[:-1]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("limited by activations (GPU memory)")


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
    # activations (sdpa, fp32), per layer: 32 tokens x (4 x 8 + 2 x 4 + 4 x 16) + q, out, k, v 32 x 4 x (2 x 2 + 2 x 1)
    # = 4,096 elements x 4 bytes + the logsumexp 32 x 2 x 4 bytes = 16,640, 2 layers; logits 2 x 16 x 40 x 8
    expected = {
        "policy parameters": 4 * p,
        "policy gradients": 4 * p,
        "policy fp32 master weights": 0,
        "policy Adam moments": 8 * p,
        "policy ZeRO-0 buckets": 0,
        "activations": 2 * 16_640,
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


def test_a_reward_model_is_counted_whole_in_fp32_on_every_rank(tmp_path):
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "rm"
    classifier = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**TINY_INIT, num_labels=1))
    classifier.save_pretrained(folder)
    size = sum(parameter.numel() for parameter in classifier.parameters())
    online = {
        "train": {"train_type": "grpo", "micro_batch_size": 2, "max_steps": 1},
        "data": {"path": str(REPO / "data/arithmetic/prompts_64.jsonl"), "max_seq_len": 16},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
    }
    config = write_job(tmp_path, **online, reward={"model_path": str(folder)})
    rows = by_name(make_plan(load_job(config), str(config), 2, 40.0, host_memory=10**12).rows)
    assert rows["reward model rm"] == (4 * size, 0)  # not partitioned: every rank scores its own responses
    components = {"components": [{"model_path": str(tmp_path / "later"), "weight": 1.0}]}
    config = write_job(tmp_path, **online, reward=components)
    rows = by_name(make_plan(load_job(config), str(config), 2, 40.0, host_memory=10**12).rows)
    assert rows[f"reward model {tmp_path / 'later'} (not there yet: not counted)"] == (0, 0)
