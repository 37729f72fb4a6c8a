"""online_ppo with real single-rank DeepSpeed engines in this process: build_run makes a policy and a critic
engine (each its own optimizer settings and clipping), the loop's warmup, versions, metrics and pinned
replay, the checkpoint's parts, the critic export, and resume from a checkpoint without critic/ (refused,
or a new critic from critic.path)."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict

import pytest
import torch

from astrai.checkpoint import CheckpointError, CheckpointPublisher, read_manifest
from astrai.config import load_job
from astrai.export.hf import export_checkpoint
from astrai.models.value import load_value_model
from astrai.training.build import build_run
from astrai.training.loops import train_online
from tests.conftest import REPO

JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 4}}
rl: {{kl_coef: 0.05, epochs_per_rollout: 2}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
critic: {{lr: 1e-3, warmup_rollouts: 1}}
train: {{train_type: online_ppo, max_steps: 3, micro_batch_size: 4, grad_accum_steps: 2, lr: 1e-3,
         lr_schedule: constant, warmup_steps: 0, seed: 5}}
checkpoint: {{every_steps: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""

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
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppo_engines")
    prompts = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines(keepends=True)[:16]
    (folder / "prompts.jsonl").write_text("".join(prompts))
    return folder


def digit_count(responses: list[str]) -> list[float]:
    """A reward a from-scratch model earns some of (it cannot do arithmetic): the digits it writes."""
    return [float(sum(character.isdigit() for character in response)) for response in responses]


def make_run(dist, folder, name, *overrides):
    config = folder / f"{name}.yaml"
    config.write_text(JOB.format(output_dir=folder / name, data=folder / "prompts.jsonl"))
    return build_run(load_job(config, list(overrides)), dist, str(config))


def records(folder, name):
    return [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]


def record_step_norms(engine, log: list) -> None:
    """Log the gradient norm the torch optimizer sees when it steps, i.e. after DeepSpeed's clipping (ZeRO-0)."""
    optimizer = engine._engine.optimizer
    original = optimizer.step

    def step(*args, **kwargs):
        gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        log.append(float(torch.nn.utils.get_total_norm(gradients)))
        return original(*args, **kwargs)

    optimizer.step = step


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_critic_clips_with_its_own_max_grad_norm(one_rank, folder):
    run = make_run(
        one_rank,
        folder,
        "clipping",
        "critic.max_grad_norm=1e-4",
        "train.max_grad_norm=100",
        "critic.warmup_rollouts=0",
        "train.max_steps=1",
        "rl.epochs_per_rollout=1",
        "checkpoint.every_steps=null",
    )
    policy, critic = run.engines["policy"], run.engines["critic"]
    assert (policy.ds_config["gradient_clipping"], critic.ds_config["gradient_clipping"]) == (100.0, 1e-4)
    policy_norms, critic_norms = [], []
    record_step_norms(policy, policy_norms)
    record_step_norms(critic, critic_norms)
    train_online(run)
    record = records(folder, "clipping")[-1]
    assert len(critic_norms) == len(policy_norms) == 2  # two minibatches, one update each
    # critic_grad_norm is the norm before clipping (what DeepSpeed reports), far above 1e-4; the gradient
    # the critic's optimizer steps with is the clipped one, of norm 1e-4.
    assert record["critic_grad_norm"] > 1e-3 and critic_norms[-1] == pytest.approx(1e-4, rel=1e-3)
    # The policy follows its own max_grad_norm 100: below it, so its stepped gradient is the reported one.
    assert record["policy_grad_norm"] < 100 and policy_norms[-1] == pytest.approx(record["policy_grad_norm"], rel=1e-5)


def test_critic_optimizer_settings_differ_from_the_policy_and_clipping_defaults_to_the_policy(one_rank, folder):
    run = make_run(
        one_rank,
        folder,
        "critic_optimizer",
        "train.lr=1e-3",
        "train.weight_decay=0.0",
        "train.lr_schedule=constant",
        "train.max_grad_norm=0.5",
        "critic.lr=4e-3",
        "critic.weight_decay=0.1",
        "critic.lr_schedule=linear",
        "critic.warmup_steps=1",
        "critic.warmup_rollouts=0",
        "checkpoint.every_steps=null",
    )
    policy, critic = run.engines["policy"], run.engines["critic"]
    # critic.max_grad_norm unset: the critic clips at train.max_grad_norm, in its config and in DeepSpeed's engine
    assert run.job.critic.max_grad_norm is None
    assert (
        critic.ds_config["gradient_clipping"]
        == policy.ds_config["gradient_clipping"]
        == 0.5
        == critic._engine.gradient_clipping()
    )
    # weight decay: matrices decay at critic.weight_decay, biases and norms not; the policy keeps train.weight_decay
    critic_groups, policy_groups = critic._engine.optimizer.param_groups, policy._engine.optimizer.param_groups
    assert [group["weight_decay"] for group in critic_groups] == [0.1, 0.0] and all(
        group["params"] for group in critic_groups
    )
    assert [group["weight_decay"] for group in policy_groups] == [0.0, 0.0]
    # LR: peak critic.lr with a linear schedule after one rollout of warmup; 3 steps x 2 epochs x 2 minibatches = 12
    # updates
    assert [group["initial_lr"] for group in critic_groups] == [4e-3, 4e-3]
    assert critic.lr == pytest.approx(4e-3 / 4)  # update 1 of a 4-update warmup
    multiplier = critic._engine.lr_scheduler.lr_lambdas[0]
    expected = [1 / 4, 2 / 4, 3 / 4, 1.0] + [
        1.0 - k / 8 for k in range(1, 9)
    ]  # warmup, then linear decay to 0 at update 12
    assert [multiplier(completed) for completed in range(12)] == pytest.approx(expected)
    # the policy: train.lr, constant, no warmup
    assert (
        policy.lr == pytest.approx(1e-3)
        and [policy._engine.lr_scheduler.lr_lambdas[0](completed) for completed in range(12)] == [1.0] * 12
    )


def test_online_ppo_loop(one_rank, folder):
    run = make_run(one_rank, folder, "loop")
    policy, critic = run.engines["policy"], run.engines["critic"]
    assert sorted(run.engines) == ["critic", "policy"] and run.strategy.required_parts == ("policy", "critic")
    ids = torch.randint(1, len(run.tokenizer), (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # trunk parity right after the warm start, inside the engines
        assert torch.equal(
            policy.module.model(input_ids=ids).last_hidden_state, critic.module.trunk(input_ids=ids).last_hidden_state
        )
    seen = defaultdict(list)  # (step, sequence) -> the advantages and returns each replay epoch read
    compute_loss = run.strategy.compute_loss

    def recording(engine, batch, normalizer):
        for ids_row, advantages, returns in zip(batch["input_ids"], batch["advantages"], batch["returns"]):
            seen[(run.strategy.current_step, tuple(ids_row.tolist()))].append((advantages.clone(), returns.clone()))
        return compute_loss(engine, batch, normalizer)

    run.strategy.compute_loss = recording
    minibatches = run.strategy.minibatches

    def tracking(targets, *, step, epoch):
        run.strategy.current_step = step
        return minibatches(targets, step=step, epoch=epoch)

    run.strategy.minibatches = tracking
    train_online(run)
    steps = records(folder, "loop")
    # Step 1 is a critic warmup rollout: values exactly 0 (zero head), no policy update, no version.
    assert steps[0]["values_mean"] == 0.0 and steps[0]["explained_variance"] == 0.0 and steps[0]["policy_version"] == 0
    assert "policy_loss" not in steps[0] and steps[0]["value_loss"] > 0 and steps[0]["critic_grad_norm"] > 0
    assert steps[1]["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy did not move during the warmup
    assert [s["policy_version"] for s in steps] == [0, 4, 8]  # 2 epochs x 2 minibatches, policy steps only
    for name in METRICS:
        assert name in steps[-1], name
    assert steps[1]["values_mean"] != 0.0  # the critic trained during the warmup
    replays = [reads for (step, _), reads in seen.items()]
    assert replays and all(len(reads) % 2 == 0 for reads in replays)  # each sequence read once per epoch
    for reads in replays:
        for advantages, returns in reads[1:]:
            assert torch.equal(advantages, reads[0][0]) and torch.equal(
                returns, reads[0][1]
            )  # pinned, never recomputed
    checkpoint = folder / "loop" / "checkpoints" / "step_00000003"
    manifest = read_manifest(checkpoint)
    assert list(manifest.parts) == ["critic", "policy"] and manifest.meta["critic"] == "the policy's starting weights"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["strategy"] == {"kl_controller": {"value": 0.05}}
    # The critic export loads back with the engine's values.
    export_checkpoint(checkpoint, folder / "critic_hf", part="critic")
    exported = load_value_model(folder / "critic_hf")
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids), critic.module(input_ids=ids), atol=1e-5)


def test_resume_without_the_critic_part(one_rank, folder, caplog):
    source = folder / "loop" / "checkpoints" / "step_00000003"
    lacking = folder / "policy_only" / "step_00000003"

    def write(staging):
        shutil.copytree(source / "policy", staging / "policy")
        for name in ("trainer_state.json", "job.yaml"):
            shutil.copy(source / name, staging / name)

    CheckpointPublisher(lacking.parent, parts=["policy"]).publish(3, write)
    refused = make_run(one_rank, folder, "refused", f"checkpoint.resume={lacking}", "train.max_steps=4")
    with pytest.raises(CheckpointError, match=r"lacks the part\(s\) critic"):
        train_online(refused)
    assert not (folder / "refused" / "metrics.jsonl").exists() or not records(folder, "refused")  # before any step
    fresh_critic = make_run(
        one_rank,
        folder,
        "new_critic",
        f"checkpoint.resume={lacking}",
        "train.max_steps=4",
        f"critic.path={folder / 'critic_hf'}",
    )
    assert fresh_critic.strategy.parts_to_resume(lacking) == ("policy",)
    state = train_online(fresh_critic)
    assert "has no critic part: starting a new critic from critic.path" in caplog.text
    assert state.step == 4 and [r["step"] for r in records(folder, "new_critic")] == [4]
    # Its export takes the critic's architecture from critic.path (a folder that could differ from the policy's).
    export_checkpoint(folder / "new_critic" / "checkpoints" / "step_00000004", folder / "new_critic_hf", part="critic")
    ids = torch.randint(1, len(fresh_critic.tokenizer), (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(
            load_value_model(folder / "new_critic_hf")(input_ids=ids),
            fresh_critic.engines["critic"].module(input_ids=ids),
            atol=1e-5,
        )
