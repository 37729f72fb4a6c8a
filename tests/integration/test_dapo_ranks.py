"""`grpo` with rl.dynamic_sampling on 2 real gloo ranks: whole groups per rank, whole minibatches, the same
kept groups in every run, and a run killed (SIGKILL) mid-way then resumed equals the uninterrupted one.

Two launches: (1) `astrai/train.py` under the deepspeed launcher with a checkpoint every step, killed with
its ranks once 3 steps are logged; (2) one launch of `dapo_rank_worker.py` (run_plan.py with the strategy
instrumented to record what each rank drew, kept and trained on) that resumes the killed run, then runs the
job twice from scratch ("straight", "repeat"). A tiny Llama from `model.init`; the reward
(`dapo_reward.py`) pays about a quarter of the responses, so about a third of the groups of 4 are all 0:
steps need second rounds, and kept groups change rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, child_env, deepspeed_launcher, free_port, launch_ranks

pytestmark = pytest.mark.slow

STEPS, PROMPTS, GROUP, RANKS = 6, 4, 4, 2
JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {folder}/prompts.jsonl, max_seq_len: 32}}
rollout: {{prompts_per_step: {prompts}, group_size: {group}, max_new_tokens: 4}}
rl: {{kl_coef: 0.0, dynamic_sampling: true, max_sampling_rounds: 3}}
reward: {{function: "tests.integration.dapo_reward:first_character_reward"}}
train: {{train_type: grpo, max_steps: {steps}, micro_batch_size: 2, grad_accum_steps: 2, lr: 5e-3,
        lr_schedule: constant, warmup_steps: 0, seed: 11}}
deepspeed: {{zero_stage: 2}}
checkpoint: {{every_steps: 1}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
COMPARED = (
    "reward_mean",
    "sampled_reward_mean",
    "sampling_rounds",
    "kept_groups",
    "dropped_groups",
    "samples",
    "loss",
    "entropy",
    "clip_frac",
    "response_len_mean",
    "policy_version",
)


def write_job(folder, name: str) -> str:
    path = folder / f"{name}.yaml"
    path.write_text(JOB.format(output_dir=folder / name, folder=folder, prompts=PROMPTS, group=GROUP, steps=STEPS))
    return str(path)


def metric_records(folder, name: str) -> list[dict]:
    lines = (folder / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def kill_after_logged_steps(folder, config: str, logged: int) -> None:
    """Launch the job on RANKS ranks and SIGKILL the whole launch once `logged` steps are in metrics.jsonl."""
    port = str(free_port())
    command = deepspeed_launcher() + [f"--num_gpus={RANKS}", "--master_port", port]
    command += ["astrai/train.py", "--config", config]
    with open(folder / "killed.log", "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    metrics = folder / "resumed" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metric_records(folder, "resumed")) >= logged:
                break
            time.sleep(0.01)
        finished_by_itself = process.poll() is not None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert not finished_by_itself, (folder / "killed.log").read_text()[-3000:]


def records(folder, name: str, kind: str) -> dict[int, list[list[dict]]]:
    """The worker's records of one kind: {step: [rank 0's records, rank 1's records]}."""
    by_step: dict[int, list[list[dict]]] = {}
    for rank in range(RANKS):
        for line in (folder / name / f"dapo_rank{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            if entry["kind"] == kind:
                by_step.setdefault(entry["step"], [[] for _ in range(RANKS)])[rank].append(entry)
    return by_step


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dapo_ranks")
    rows = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines()[:32]
    with_ids = [json.dumps({**json.loads(row), "id": index}) + "\n" for index, row in enumerate(rows)]
    (folder / "prompts.jsonl").write_text("".join(with_ids))
    kill_after_logged_steps(folder, write_job(folder, "resumed"), logged=3)
    killed_at = len(metric_records(folder, "resumed"))
    runs = [{"name": name, "config": write_job(folder, name)} for name in ("resumed", "straight", "repeat")]
    plan, results = folder / "plan.json", folder / "results.json"
    plan.write_text(json.dumps({"results": str(results), "runs": runs}))
    completed = launch_ranks([REPO / "tests/integration/dapo_rank_worker.py", "--plan", plan], RANKS, 900)
    (folder / "launch.log").write_text(completed.stdout + completed.stderr)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return folder, json.loads(results.read_text()), killed_at


def test_every_rank_trains_on_whole_groups_in_whole_minibatches(launched):
    folder, results, _ = launched
    assert all(result["ok"] for result in results.values()), results
    metrics = metric_records(folder, "straight")
    steps, rounds = records(folder, "straight", "step"), records(folder, "straight", "round")
    minibatches = records(folder, "straight", "minibatch")
    exchanged = 0
    for record in metrics:
        step = record["step"]
        per_rank = [entries[0] for entries in steps[step]]
        kept = 0
        for rank, entry in enumerate(per_rank):
            ids, rewards = entry["ids"], entry["rewards"]
            assert len(ids) == PROMPTS // RANKS * GROUP  # the same share as without dynamic sampling
            groups = [ids[start : start + GROUP] for start in range(0, len(ids), GROUP)]
            assert all(len(set(group)) == 1 for group in groups), ids  # a group is one prompt's responses, whole
            kept += sum(len(set(rewards[start : start + GROUP])) > 1 for start in range(0, len(rewards), GROUP))
            # Every rank: 2 optimizer steps of 2 micro-batches of 2 sequences (M x A = 4 per rank).
            assert [m["micro_batches"] for m in minibatches[step][rank]] == [[2, 2], [2, 2]]
            own_draws = {prompt for draw in rounds[step][rank] for prompt in draw["ids"]}
            exchanged += sum(group[0] not in own_draws for group in groups)
        assert kept == record["kept_groups"]
        assert len(rounds[step][0]) == record["sampling_rounds"]
        assert per_rank[0]["prompts_drawn"] == record["sampling_rounds"] * PROMPTS
        assert record["dropped_groups"] == record["sampling_rounds"] * PROMPTS - PROMPTS
    # The data position counts every prompt drawn.
    drawn = [sum(m["sampling_rounds"] for m in metrics[: i + 1]) * PROMPTS for i in range(STEPS)]
    assert [r["samples"] for r in metrics] == drawn
    # The test's reward makes the dynamic part happen: extra rounds, dropped groups, and groups dealt to the other rank.
    assert max(r["sampling_rounds"] for r in metrics) > 1
    assert sum(r["dropped_groups"] for r in metrics) > 0 and exchanged > 0


def test_kept_groups_are_the_same_in_every_run(launched):
    folder, results, _ = launched
    assert results["straight"]["ok"] and results["repeat"]["ok"], results
    straight, repeat = records(folder, "straight", "step"), records(folder, "repeat", "step")
    assert straight == repeat
    for field in COMPARED:
        straight_values = [r[field] for r in metric_records(folder, "straight")]
        assert straight_values == [r[field] for r in metric_records(folder, "repeat")], field


def test_a_killed_run_resumes_to_the_uninterrupted_one(launched):
    folder, results, killed_at = launched
    assert results["resumed"]["ok"], results
    resumed, straight = metric_records(folder, "resumed"), metric_records(folder, "straight")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for field in COMPARED:
        assert [r[field] for r in resumed] == pytest.approx([r[field] for r in straight], rel=1e-5, abs=1e-7), field
    # The resumed launch's own steps (after the checkpoint the kill left) kept the same groups and responses.
    after = records(folder, "resumed", "step")
    assert after and 1 < min(after) <= killed_at + 1 and max(after) == STEPS
    reference = records(folder, "straight", "step")
    assert all(after[step] == reference[step] for step in after)
    state = json.loads((folder / "resumed" / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())
    assert state["consumed_samples"] == straight[-1]["samples"]
