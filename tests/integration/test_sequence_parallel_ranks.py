"""Ulysses sequence parallelism on 2 real gloo ranks: `parallel.sequence_parallel_size: 2` trains as 1 rank per
sequence does (sp=1, data parallel over the same 2 ranks, half the accumulation): the same losses, gradient
norms, metrics, eval figures and final weights, for every train type (seq with documents masked, sft padded,
packed and with LoRA, dpo with its reference live and precomputed, simpo, rm, grpo with its reference, online_ppo
with its critic), under ZeRO-2 and ZeRO-3; an sp=2 checkpoint resumes on sp=1; bad sizes are refused before any
step.

All runs share ONE launch. Tolerance: the two runs compute the same sums in a different order and cut (fp32 on
a CPU: relative differences of ~1e-7 measured); 1e-5 relative, as the issue asks; the weights after 4 Adam steps
to 1e-4 in norm per tensor (Adam divides each entry's gradient by its own RMS, so rounding in a near-zero gradient
moves that entry by up to the learning rate).
"""

from __future__ import annotations

import math

import pytest

from astrai.engine import consolidated_state_dict
from tests.conftest import REPO, launch_ranks
from tests.integration.plan import launch_plan, metrics, write_job

pytestmark = pytest.mark.slow
RTOL = 1e-5
SP2 = "parallel.sequence_parallel_size=2"
WEIGHTS_RTOL = 1e-4  # after 4 Adam steps (measured: <= 1.6e-5)
STEPS = 4
# (name, train type, extra keys): each trained both ways.
CASES = [
    ("sft_z2", "sft", ["deepspeed.zero_stage=2"]),
    ("sft_z3", "sft", ["deepspeed.zero_stage=3"]),
    ("sft_packed", "sft", ["data.packing=true", "train.micro_batch_tokens=96"]),
    ("seq_documents", "seq", ["data.document_mask=true"]),
    ("dpo", "dpo", ["dpo.beta=0.5"]),
    ("dpo_precomputed", "dpo", ["dpo.beta=0.5", "dpo.precompute_reference=true", "deepspeed.zero_stage=3"]),
    ("simpo_packed", "dpo", ["dpo.loss=simpo", "data.packing=true", "train.micro_batch_tokens=160"]),
    ("rm", "rm", []),
    ("sft_lora", "sft", ["model.lora={r: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj]}"]),
]
EVAL = ["eval.holdout=8", "eval.every_steps=2"]
# The online train types from a fresh tiny model, with a reward that varies (a random model's first characters):
# 4 prompts x 4 responses a step, one optimizer update per step (so the replay order, which differs between the
# two layouts, cannot change the sum). sp=2: each rank of the group samples 2 of the prompts with the seed a
# data-parallel rank would use, and the group trains on the gathered 16.
ONLINE_JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 6}}
rl: {{kl_coef: 0.04}}
reward: {{function: "tests.integration.dapo_reward:first_character_reward"}}
train: {{train_type: {train_type}, max_steps: 3, micro_batch_size: 4, lr: 5e-3, lr_schedule: constant, warmup_steps: 0,
         seed: 7}}
deepspeed: {{zero_stage: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
ONLINE_CASES = [("grpo", "grpo", []), ("online_ppo_z3", "online_ppo", ["deepspeed.zero_stage=3"])]


def _both_ways(name: str, sets: list[str]) -> tuple[list[str], list[str]]:
    """(sp=1 on 2 data-parallel ranks, sp=2 on one data-parallel rank with twice the accumulation)."""
    common = [f"train.max_steps={STEPS}", "train.micro_batch_size=2", *EVAL, *sets]
    return common + ["train.grad_accum_steps=1"], common + [
        "train.grad_accum_steps=2",
        "parallel.sequence_parallel_size=2",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sequence_parallel")
    runs = []
    for name, train_type, sets in CASES:
        data_parallel, sequence_parallel = _both_ways(name, sets)
        runs.append({"name": f"{name}_dp", "config": write_job(folder, f"{name}_dp", train_type), "set": data_parallel})
        runs.append(
            {"name": f"{name}_sp", "config": write_job(folder, f"{name}_sp", train_type), "set": sequence_parallel}
        )
    for name, train_type, sets in ONLINE_CASES:
        for suffix, extra in (("dp", ["train.grad_accum_steps=2"]), ("sp", ["train.grad_accum_steps=4", SP2])):
            config = folder / f"{name}_{suffix}.yaml"
            data = REPO / "data/arithmetic/prompts_64.jsonl"
            output_dir = folder / f"{name}_{suffix}"
            config.write_text(ONLINE_JOB.format(output_dir=output_dir, data=data, train_type=train_type))
            runs.append({"name": f"{name}_{suffix}", "config": str(config), "set": [*sets, *extra]})
    # An sp=2 run checkpointed at step 2, resumed on sp=1 (2 data-parallel ranks) to step 4.
    _, resume_first = _both_ways("resume", ["checkpoint.every_steps=2", "deepspeed.zero_stage=2"])
    config = write_job(folder, "resume", "sft")
    runs.append(
        {"name": "resume_sp", "config": config, "set": [*resume_first[:-2], "train.max_steps=2", *resume_first[-2:]]}
    )
    runs.append({"name": "resume_dp", "config": config, "set": _both_ways("resume", ["checkpoint.every_steps=2"])[0]})
    # An sp=2 run stopped at step 2 and resumed as sp=2: exactly sft_z2_sp, the run that never stopped.
    again = write_job(folder, "again", "sft")
    runs.append(
        {"name": "again_first", "config": again, "set": [*resume_first[:-2], "train.max_steps=2", *resume_first[-2:]]}
    )
    runs.append({"name": "again_rest", "config": again, "set": resume_first})
    runs.append(
        {
            "name": "three_of_two",
            "config": write_job(folder, "three", "sft"),
            "set": ["parallel.sequence_parallel_size=3"],
            "expect_error": "does not divide the world size 2",
        }
    )
    results = launch_plan(folder, runs)
    return folder, results


def _close(a: float, b: float, what: str) -> None:
    # abs_tol: a difference of sums (DPO's margin, ~3e-3 here, of rewards built from log-probs ~30) keeps their
    # absolute rounding (~1e-7 measured), not a relative one.
    assert math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-6), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("case", [case[0] for case in CASES + ONLINE_CASES])
def test_sequence_parallel_trains_as_data_parallel(trained, case):
    folder, results = trained
    steps = 3 if case in dict((name, 0) for name, *_ in ONLINE_CASES) else STEPS
    for suffix in ("dp", "sp"):
        assert results[f"{case}_{suffix}"]["ok"], results[f"{case}_{suffix}"]["error"]
        assert results[f"{case}_{suffix}"]["step"] == steps
    data_parallel, sequence_parallel = metrics(folder, f"{case}_dp"), metrics(folder, f"{case}_sp")
    assert [r["step"] for r in data_parallel] == [r["step"] for r in sequence_parallel]
    compared = 0
    for left, right in zip(data_parallel, sequence_parallel):
        for key, value in left.items():
            if key in ("step", "lr", "epoch", "samples") or key.endswith("_s") or not isinstance(value, float | int):
                continue
            _close(value, right[key], f"{case} step {left['step']} {key}")
            compared += 1
        assert left["samples"] == right["samples"]  # the same rows drawn
    assert compared >= steps * 3  # loss, grad_norm, tokens at least, and the eval figures
    assert steps == 3 or any("eval/loss" in record for record in sequence_parallel)
    final = f"checkpoints/step_{steps:08d}/policy"
    weights_dp = consolidated_state_dict(folder / f"{case}_dp" / final)
    weights_sp = consolidated_state_dict(folder / f"{case}_sp" / final)
    assert weights_dp.keys() == weights_sp.keys()
    for key in weights_dp:  # Adam moves an entry whose gradient is ~0 by up to lr whatever its rounding: by norm
        difference = float((weights_sp[key] - weights_dp[key]).detach().norm() / weights_dp[key].detach().norm())
        assert difference < WEIGHTS_RTOL, f"{case} {key}: relative difference {difference}"


def test_sequence_parallel_checkpoint_resumes_on_data_parallel_and_on_one_rank(trained):
    """The sp=2 checkpoint of step 2 goes on as sp=1 on the same 2 ranks (in the launch) and on 1 rank (here):
    both reach the losses of the run that never stopped."""
    folder, results = trained
    assert results["resume_sp"]["ok"] and results["resume_sp"]["step"] == 2, results["resume_sp"]
    assert results["resume_dp"]["ok"] and results["resume_dp"]["step"] == STEPS, results["resume_dp"]
    checkpoint = folder / "resume" / "checkpoints" / "step_00000002"
    one_rank = [
        f"output_dir={folder / 'resume_one'}",
        f"checkpoint.resume={checkpoint}",
        "train.grad_accum_steps=2",
        *[entry for entry in _both_ways("resume", [])[0] if not entry.startswith("train.grad_accum_steps")],
    ]
    command = ["astrai/train.py", "--config", folder / "resume.yaml"]
    command += [part for setting in one_rank for part in ("--set", setting)]
    finished = launch_ranks(command, 1, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    straight = {r["step"]: r for r in metrics(folder, "sft_z2_dp")}
    for name in ("resume", "resume_one"):
        resumed = metrics(folder, name)
        assert [r["step"] for r in resumed][-2:] == [3, 4], name
        for record in resumed[-2:]:
            _close(record["loss"], straight[record["step"]]["loss"], f"{name}: resumed step {record['step']} loss")


def test_a_sequence_parallel_run_resumes_exactly(trained):
    folder, results = trained
    assert results["again_rest"]["ok"] and results["again_rest"]["step"] == STEPS, results["again_rest"]
    straight = {r["step"]: r for r in metrics(folder, "sft_z2_sp")}
    resumed = metrics(folder, "again")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for record in resumed[2:]:  # exact: the same ranks, cuts and reductions as the straight run
        assert record["loss"] == straight[record["step"]]["loss"], record["step"]
        assert record["grad_norm"] == straight[record["step"]]["grad_norm"], record["step"]


def test_a_size_that_does_not_divide_the_world_is_refused(trained):
    _, results = trained
    outcome = results["three_of_two"]
    assert not outcome["ok"] and "parallel.sequence_parallel_size: 3" in outcome["error"], outcome
