"""Ulysses sequence parallelism on 2 real gloo ranks: `parallel.sequence_parallel_size: 2` trains as 1 rank per
sequence does (sp=1, data parallel over the same 2 ranks, half the accumulation): the same losses, gradient
norms, metrics, eval figures and final weights, for every offline train type that takes it (seq with documents
masked, sft padded and packed, dpo with its reference live and precomputed, simpo), under ZeRO-2 and ZeRO-3; an
sp=2 checkpoint resumes on sp=1; bad sizes are refused before any step.

All runs share ONE launch. Tolerance: the two runs compute the same sums in a different order and cut (fp32 on
a CPU: relative differences of ~1e-7 measured); 1e-5 relative, as the issue asks; the weights after 4 Adam steps
to 1e-4 in norm per tensor (Adam divides each entry's gradient by its own RMS, so rounding in a near-zero gradient
moves that entry by up to the learning rate).
"""

from __future__ import annotations

import math

import pytest

from astrai.engine import consolidated_state_dict
from tests.integration.plan import launch_plan, metrics, write_job

pytestmark = pytest.mark.slow
RTOL = 1e-5
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
]
EVAL = ["eval.holdout=8", "eval.every_steps=2"]


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
    # An sp=2 run checkpointed at step 2, resumed on sp=1 (2 data-parallel ranks) to step 4.
    _, resume_first = _both_ways("resume", ["checkpoint.every_steps=2", "deepspeed.zero_stage=2"])
    config = write_job(folder, "resume", "sft")
    runs.append(
        {"name": "resume_sp", "config": config, "set": [*resume_first[:-2], "train.max_steps=2", *resume_first[-2:]]}
    )
    runs.append({"name": "resume_dp", "config": config, "set": _both_ways("resume", ["checkpoint.every_steps=2"])[0]})
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


@pytest.mark.parametrize("case", [case[0] for case in CASES])
def test_sequence_parallel_trains_as_data_parallel(trained, case):
    folder, results = trained
    for suffix in ("dp", "sp"):
        assert results[f"{case}_{suffix}"]["ok"], results[f"{case}_{suffix}"]["error"]
        assert results[f"{case}_{suffix}"]["step"] == STEPS
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
    assert compared >= STEPS * 3  # loss, grad_norm, tokens at least, and the eval figures
    assert any("eval/loss" in record for record in sequence_parallel)
    final = f"checkpoints/step_{STEPS:08d}/policy"
    weights_dp = consolidated_state_dict(folder / f"{case}_dp" / final)
    weights_sp = consolidated_state_dict(folder / f"{case}_sp" / final)
    assert weights_dp.keys() == weights_sp.keys()
    for key in weights_dp:  # Adam moves an entry whose gradient is ~0 by up to lr whatever its rounding: by norm
        difference = float((weights_sp[key] - weights_dp[key]).norm() / weights_dp[key].norm())
        assert difference < WEIGHTS_RTOL, f"{case} {key}: relative difference {difference}"


def test_sequence_parallel_checkpoint_resumes_on_data_parallel(trained):
    folder, results = trained
    assert results["resume_sp"]["ok"] and results["resume_sp"]["step"] == 2, results["resume_sp"]
    assert results["resume_dp"]["ok"] and results["resume_dp"]["step"] == STEPS, results["resume_dp"]
    straight = {r["step"]: r for r in metrics(folder, "sft_z2_dp")}
    resumed = metrics(folder, "resume")
    assert [r["step"] for r in resumed][-2:] == [3, 4]
    for record in resumed[-2:]:
        _close(record["loss"], straight[record["step"]]["loss"], f"resumed step {record['step']} loss")


def test_a_size_that_does_not_divide_the_world_is_refused(trained):
    _, results = trained
    outcome = results["three_of_two"]
    assert not outcome["ok"] and "parallel.sequence_parallel_size: 3" in outcome["error"], outcome
