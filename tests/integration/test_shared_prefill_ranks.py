"""`rollout.share_prefill` under ZeRO-3 on 2 real gloo ranks: one prefill per prompt group samples what
prefilling every copy samples, from the ZeRO-3 generation copy (`rollout.zero3_generation: copy`, the
default) and from the partitioned module inside one gather (`gather`, where every forward is a collective
and the ranks agree on sharing), with rl.dynamic_sampling's rounds and two replay epochs (so the behaviour
log-probs, kept from the sampler in fp32, enter the ratio).

ONE launch runs the four jobs. A tiny Llama from `model.init`; the reward (`dapo_reward.py`) pays about a
quarter of the responses, so groups differ and some steps need a second sampling round. Same seed, same
tokens: every rollout metric is equal, and the losses agree to the ~1e-7 the sampler's log-probs may move.

The same launch runs `rl.share_prefix` (the policy's two forwards per micro-batch, prefix then responses, and
the partitioned reference's) against the plain forwards under ZeRO-3's `gather`, with one optimizer step per
rollout so that the replay's grouped order cannot change the update: every step's metrics agree; and online_ppo
the same way, whose critic (its own ZeRO-3 engine) runs the two forwards too.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.integration.plan import launch_plan, metrics

pytestmark = pytest.mark.slow

# What every job of the launch shares: a tiny Llama from `model.init`, ZeRO-3.
COMMON = """\
output_dir: {folder}/{name}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
  zero3_init: false
tokenizer: {{build: {{kind: char}}}}
data: {{path: {folder}/prompts.jsonl, max_seq_len: 32}}
deepspeed: {{zero_stage: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
JOB = (
    COMMON
    + """\
rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 6, zero3_generation: {mode}, share_prefill: {share}}}
rl: {{kl_coef: 0.04, dynamic_sampling: true, max_sampling_rounds: 3, epochs_per_rollout: {epochs},
     share_prefix: {prefix}}}
reward: {{function: "tests.integration.dapo_reward:first_character_reward"}}
train: {{train_type: grpo, max_steps: 3, micro_batch_size: 2, grad_accum_steps: {accumulation}, lr: 5e-3,
        lr_schedule: constant, warmup_steps: 0, seed: 11}}
"""
)
PPO_JOB = (
    COMMON
    + """\
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 6}}
rl: {{kl_coef: 0.04, share_prefix: {prefix}}}
reward: {{function: "tests.integration.dapo_reward:first_character_reward"}}
critic: {{lr: 5e-3}}
train: {{train_type: online_ppo, max_steps: 3, micro_batch_size: 2, grad_accum_steps: 2, lr: 5e-3,
        lr_schedule: constant, warmup_steps: 0, seed: 11}}
"""
)
PPO_CLOSE = ("loss", "policy_loss", "value_loss", "kl", "entropy")
REPLAY = {"epochs": 2, "accumulation": 2}  # two optimizer steps per epoch, two epochs
EQUAL = ("reward_mean", "sampled_reward_mean", "sampling_rounds", "kept_groups", "response_len_mean", "samples")
CLOSE = ("loss", "entropy", "kl", "clip_frac")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared_prefill_ranks")
    rows = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines()[:32]
    (folder / "prompts.jsonl").write_text("".join(row + "\n" for row in rows))
    runs = []
    for mode in ("copy", "gather"):
        for share in ("true", "false"):
            name = f"{mode}_{share}"
            config = folder / f"{name}.yaml"
            config.write_text(JOB.format(**REPLAY, folder=folder, name=name, mode=mode, share=share, prefix="false"))
            runs.append({"name": name, "config": str(config)})
    for prefix in ("true", "false"):  # 8 sequences a rank = one optimizer step of 2 x 4
        name = f"prefix_{prefix}"
        config = folder / f"{name}.yaml"
        job = JOB.format(folder=folder, name=name, mode="gather", share="true", epochs=1, accumulation=4, prefix=prefix)
        config.write_text(job)
        runs.append({"name": name, "config": str(config)})
        name = f"ppo_prefix_{prefix}"  # 4 sequences a rank = one policy and one critic step of 2 x 2
        config = folder / f"{name}.yaml"
        config.write_text(PPO_JOB.format(folder=folder, name=name, prefix=prefix))
        runs.append({"name": name, "config": str(config)})
    return folder, launch_plan(folder, runs)


@pytest.mark.parametrize("mode", ["copy", "gather"])
def test_zero3_shared_prefill_samples_what_every_copy_samples(launched, mode):
    folder, results = launched
    for share in ("true", "false"):
        assert results[f"{mode}_{share}"]["ok"], results[f"{mode}_{share}"]
    shared, unshared = metrics(folder, f"{mode}_true"), metrics(folder, f"{mode}_false")
    assert [r["step"] for r in shared] == [r["step"] for r in unshared] == [1, 2, 3]
    for field in EQUAL:
        assert [r[field] for r in shared] == [r[field] for r in unshared], field
    for field in CLOSE:
        assert [r[field] for r in shared] == pytest.approx([r[field] for r in unshared], rel=1e-5, abs=1e-6), field
    # Not a vacuous comparison: rewards vary, and the replayed minibatches moved the policy.
    assert 0 < sum(r["reward_mean"] for r in shared) < 3 and shared[-1]["kl"] > 0


@pytest.mark.parametrize("train_type", ["grpo", "online_ppo"])
def test_zero3_share_prefix_trains_as_the_plain_forwards(launched, train_type):
    folder, results = launched
    stem = "prefix" if train_type == "grpo" else "ppo_prefix"
    for prefix in ("true", "false"):
        assert results[f"{stem}_{prefix}"]["ok"], results[f"{stem}_{prefix}"]
    shared, plain = metrics(folder, f"{stem}_true"), metrics(folder, f"{stem}_false")
    assert [r["step"] for r in shared] == [r["step"] for r in plain] == [1, 2, 3]
    equal = EQUAL if train_type == "grpo" else ("reward_mean", "response_len_mean")
    for field in equal:
        assert [r[field] for r in shared] == [r[field] for r in plain], field
    for field in CLOSE if train_type == "grpo" else PPO_CLOSE:
        assert [r[field] for r in shared] == pytest.approx([r[field] for r in plain], rel=1e-5, abs=1e-6), field
    assert 0 < sum(r["reward_mean"] for r in shared) < 3 and shared[-1]["kl"] > 0  # the policy moved
