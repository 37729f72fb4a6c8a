"""`online_ppo` on 2 real gloo ranks: under ZeRO-2 and ZeRO-3 the reward rises and the critic's explained
variance goes from exactly 0 to clearly positive; resume restores policy, critic and the adaptive KL
coefficient exactly; a checkpoint without critic/ is refused before any step, naming the part.

ONE launch runs everything (a launch costs 10-20 s of imports): a short SFT of a tiny Llama on 32 shipped
arithmetic chats, exported on finish, then every online_ppo job from that export on the 32 matching
prompts with the shipped verifier `astrai.rollout.rewards:arithmetic_exact_match`.

Why the trend assertions cannot be met by chance: exact match of the whole answer gives a policy that
does not learn a flat reward; the last 10 steps' mean (1280 responses) must beat the first 10 steps' by
0.1, where the standard error of such a difference at p ~ 0.3 is about 0.02 (sampling noise). The
critic's head starts at zero, so the first explained variance is exactly 0; a critic that learns
nothing stays near 0 (a constant critic cannot explain variance), while the last 10 steps must average
above 0.2 (measured: reward 0.26 -> 0.46, explained variance 0.005 -> 0.47, the same under both stages).
"""

from __future__ import annotations

import json

import pytest

from astrai.checkpoint import CheckpointPublisher
from tests.integration.plan import arithmetic_sft_run, launch_plan, metrics

pytestmark = pytest.mark.slow

# 2 ranks x 8 prompts x 8 responses; 64 per rank = 2 minibatches of 16 x 2: two policy and two critic updates per
# rollout.
PPO_JOB = """\
output_dir: {folder}/{name}
model: {{path: {folder}/sft_hf}}
data: {{path: {folder}/prompts.jsonl, max_seq_len: 32}}
rollout: {{prompts_per_step: 16, group_size: 8, max_new_tokens: 4}}
rl: {{kl_coef: 0.05, kl_estimator: k1}}
reward: {{function: "astrai.rollout.rewards:arithmetic_exact_match"}}
critic: {{lr: 2e-3}}
train: {{train_type: online_ppo, max_steps: {steps}, micro_batch_size: 16, grad_accum_steps: 2, lr: 5e-4,
         lr_schedule: constant, warmup_steps: 0, seed: 7}}
deepspeed: {{zero_stage: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""

TREND_STEPS = 60
# Replay twice, checkpoint every 2 steps, an adaptive KL coefficient (its state must cross the checkpoint)
# and the critic in its own ZeRO-3 engine beside a ZeRO-2 policy.
RESUME = [
    "rl.epochs_per_rollout=2",
    "checkpoint.every_steps=2",
    "rl.target_kl=0.001",
    "rl.kl_horizon=500",
    "critic.zero_stage=3",
]
COMPARED = (
    "reward_mean",
    "loss",
    "policy_loss",
    "value_loss",
    "kl",
    "kl_coef",
    "clip_frac",
    "value_clip_frac",
    "approx_kl",
    "entropy",
    "values_mean",
    "returns_mean",
    "advantages_mean",
    "advantages_std",
    "explained_variance",
    "critic_grad_norm",
    "policy_grad_norm",
)
METRICS = (
    "reward_mean",
    "kl",
    "policy_loss",
    "value_loss",
    "clip_frac",
    "value_clip_frac",
    "approx_kl",
    "entropy",
    "advantages_mean",
    "advantages_std",
    "returns_mean",
    "values_mean",
    "explained_variance",
    "policy_grad_norm",
    "critic_grad_norm",
    "rollout_s",
    "train_s",
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppo_ranks")
    runs = [arithmetic_sft_run(folder)]

    def add(name, sets=(), config_name=None, steps=4, **extra):
        config = folder / f"{config_name or name}.yaml"
        config.write_text(PPO_JOB.format(folder=folder, name=config_name or name, steps=steps))
        runs.append({"name": name, "config": str(config), "set": list(sets), **extra})

    add("zero2", steps=TREND_STEPS)
    add("zero3", ["deepspeed.zero_stage=3"], steps=TREND_STEPS)  # partitioned loading of policy, reference and critic
    add("straight", RESUME)
    add("split_a", RESUME + ["train.max_steps=2"], config_name="split")
    add("split_b", RESUME, config_name="split")
    # The same resume with both engines on another ZeRO stage (policy 2 -> 3, critic 3 -> 2): both convert.
    add(
        "restaged",
        RESUME
        + [
            "deepspeed.zero_stage=3",
            "critic.zero_stage=2",
            f"checkpoint.resume={folder / 'split' / 'checkpoints' / 'step_00000002'}",
        ],
    )
    # A checkpoint with a policy but no critic (as a grpo job leaves): refused before any step.
    lacking = folder / "lacking" / "step_00000002"
    CheckpointPublisher(lacking.parent, parts=["policy"]).publish(
        2, lambda staging: (staging / "policy").mkdir() or (staging / "policy" / "w").write_text("x")
    )
    add("no_critic", [f"checkpoint.resume={lacking}"], expect_error="lacks the part(s) critic")
    return folder, launch_plan(folder, runs)


def mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_reward_rises_and_the_critic_explains_variance(launched, name):
    folder, results = launched
    assert results["sft"]["ok"] and results[name]["ok"], results
    records = metrics(folder, name)
    assert [r["step"] for r in records] == list(range(1, TREND_STEPS + 1))
    for field in METRICS:
        assert field in records[-1], field
    # The zero-initialised head: the first rollout's values are exactly 0, so is its explained variance.
    assert (
        records[0]["values_mean"] == 0.0
        and records[0]["explained_variance"] == 0.0
        and records[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    )
    assert [r["policy_version"] for r in records[:3]] == [2, 4, 6]
    rewards = [r["reward_mean"] for r in records]
    explained = [r["explained_variance"] for r in records]
    assert mean(rewards[-10:]) - mean(rewards[:10]) > 0.1, rewards
    assert mean(explained[-10:]) > 0.2, explained


def test_exact_resume_of_policy_critic_and_kl_controller(launched):
    folder, results = launched
    for name in ("straight", "split_a", "split_b"):
        assert results[name]["ok"], results[name]
    straight, resumed = metrics(folder, "straight"), metrics(folder, "split")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in straight] == [4, 8, 12, 16]  # 2 epochs x 2 minibatches per rollout
    assert straight[-1]["kl_coef"] != straight[0]["kl_coef"]  # the adaptive coefficient moved
    for field in COMPARED:
        assert [r[field] for r in resumed] == pytest.approx([r[field] for r in straight], rel=1e-5, abs=1e-7), field
    checkpoint = folder / "split" / "checkpoints" / "step_00000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["parts"] == ["critic", "policy"] and manifest["meta"]["zero_stage"] == {"critic": 3, "policy": 2}
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["policy_version"] == 16 and state["strategy"]["kl_controller"]["value"] not in (
        0.05,
        straight[0]["kl_coef"],
    )


def test_resume_on_other_zero_stages_converts_policy_and_critic(launched):
    """Steps 3-4 after converting both engines (policy ZeRO-2 -> 3, critic ZeRO-3 -> 2) match the straight
    run: the same responses are sampled (same seeds, same weights), losses to reduction-order noise."""
    folder, results = launched
    assert results["restaged"]["ok"], results["restaged"]
    straight, restaged = metrics(folder, "straight")[2:], metrics(folder, "restaged")
    assert [r["step"] for r in restaged] == [3, 4] and [r["policy_version"] for r in restaged] == [12, 16]
    for field in (
        "reward_mean",
        "loss",
        "policy_loss",
        "value_loss",
        "kl",
        "kl_coef",
        "values_mean",
        "returns_mean",
        "explained_variance",
    ):
        assert [r[field] for r in restaged] == pytest.approx([r[field] for r in straight], rel=1e-4, abs=1e-6), field
    portable = folder / "split" / "checkpoints" / "portable" / "step_00000002"
    assert json.loads((portable / "manifest.json").read_text())["parts"] == ["critic", "policy"]
    for part in ("policy", "critic"):
        assert (portable / part / "fp32.safetensors").is_file() and (
            portable / part / "exp_avg_sq.safetensors"
        ).is_file()
    manifest = json.loads((folder / "restaged" / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["meta"]["zero_stage"] == {"critic": 2, "policy": 3}


def test_resume_without_the_critic_part_is_refused(launched):
    folder, results = launched
    assert not results["no_critic"]["ok"]
    error = results["no_critic"]["error"]
    assert "lacks the part(s) critic" in error and "CheckpointError" in error, error
    assert not (folder / "no_critic" / "metrics.jsonl").exists()  # before any step
