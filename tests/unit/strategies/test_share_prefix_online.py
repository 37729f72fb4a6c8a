"""`rl.share_prefix`: grpo's and online_ppo's policy and reference forwards (and the rollout's behaviour
forward) run each distinct prompt once; the frozen targets, the losses, their sums and the gradients equal
the plain forwards' (fp32, CPU, within 1e-5), and the replay moves whole groups."""

from __future__ import annotations

import copy

import pytest
import torch

from astrai.config import ConfigError, JobConfig
from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.generation import generate_rollout
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.scoring import SharedPrefixForward
from astrai.strategies.grpo import GrpoStrategy
from tests.unit.rollout_fixtures import PlainEngine, behaviour_scoring, online_job
from tests.unit.strategies.test_packing_online import (
    TINY,
    assert_same_targets,
    assert_same_update,
    first_minibatch,
    minibatch_update,
    ppo_setup,
    ppo_updates,
    setup,
)

# One optimizer step holds the whole rollout (2 prompts x 4 responses = micro-batch 4 x 2 accumulation), so the
# update's sums do not depend on the order the replay takes the sequences in.
WHOLE_ROLLOUT = {"micro_batch_size": 4, "grad_accum_steps": 2}


def distinct_prompts(batch: dict) -> int:
    prompt_len = batch["input_ids"].shape[1] - batch["response_ids"].shape[1]
    return len({tuple(row) for row in batch["input_ids"][:, :prompt_len].tolist()})


def test_grpo_targets_loss_and_gradients_equal_the_plain_forwards(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    updates, targets, prompts_per_micro_batch = [], [], []
    for share in (False, True):
        config = online_job("grpo", TINY, rl={"kl_coef": 0.1, "share_prefix": share}, train=WHOLE_ROLLOUT)
        strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        micro_batches = first_minibatch(strategy, pinned)
        prompts_per_micro_batch.append([distinct_prompts(batch) for batch in micro_batches])
        updates.append(minibatch_update(strategy, strategy.compute_loss, policy, micro_batches))
    assert_same_targets(*targets)
    assert_same_update(*updates)
    assert prompts_per_micro_batch[1] == [1, 1]  # whole groups: each micro-batch of 4 is one prompt's responses


def test_online_ppo_policy_reference_and_critic_equal_the_plain_forwards(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    critic = ValueModel(trunk_of(copy.deepcopy(policy)))
    torch.manual_seed(2)
    torch.nn.init.normal_(critic.value_head.weight, std=0.02)
    updates, targets = [], []
    for share in (False, True):
        config = online_job("online_ppo", TINY, rl={"kl_coef": 0.1, "share_prefix": share}, train=WHOLE_ROLLOUT)
        strategy = ppo_setup(config, tokenizer, reference, critic)
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        updates.append(ppo_updates(strategy, pinned, policy, critic))
    assert_same_targets(*targets)  # the critic's frozen values and the advantages from them included
    for plain, shared in zip(*updates):
        assert_same_update(plain, shared)


def test_behaviour_logprobs_of_the_rollout_equal_the_plain_forward(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4+17=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    settings = online_job("grpo", TINY, rollout={"max_new_tokens": 8}).rollout
    scoring = behaviour_scoring(settings, tokenizer, 3, variant=SharedPrefixForward)
    shared = generate_rollout(
        PlainEngine(policy), tokenizer, Prompts(prompts, chats, [{}, {}]), settings, seed=5, scoring=scoring
    )
    assert torch.equal(shared.response_ids, result.response_ids)
    torch.testing.assert_close(shared.behaviour_logprobs, result.behaviour_logprobs, atol=1e-5, rtol=0)


def test_the_replay_moves_whole_groups_and_every_sequence_once(tokenizer, rollout_and_models):
    result, _, reference = rollout_and_models
    config = online_job("grpo", TINY, rl={"share_prefix": True}, train={"micro_batch_size": 2, "grad_accum_steps": 2})
    strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
    pinned = strategy.frozen_targets(copy.copy(result))
    for epoch in (0, 1):
        rows = []
        for micro_batches in strategy.minibatches(pinned, step=1, epoch=epoch):
            for batch in micro_batches:
                rows.extend(batch["advantages"].tolist())
                assert distinct_prompts(batch) == 1  # 2 responses of one group
        assert sorted(rows) == sorted(pinned["advantages"].tolist())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"rl": {"share_prefix": True, "packing": True}}, "`rl.share_prefix` with `rl.packing`: use one of them"),
        (
            {"model": {"init": TINY, "gradient_checkpointing": True}, "rl": {"share_prefix": True}},
            "`rl.share_prefix` with `model.gradient_checkpointing`",
        ),
        (
            {"rl": {"share_prefix": True}, "rollout": {"group_size": 1}},
            "`rl.share_prefix` with `rollout.group_size: 1`: each prompt has one response",
        ),
    ],
)
def test_combinations_it_cannot_serve_are_refused_naming_the_keys(sections, message):
    with pytest.raises(ValueError, match=message):
        online_job("grpo", TINY, **sections)


def test_refused_outside_the_online_train_types():
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": TINY},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": "unused.jsonl"},
        "train": {"train_type": "sft", "max_steps": 3},
        "rl": {"share_prefix": True},
    }
    with pytest.raises((ValueError, ConfigError), match="`rl.share_prefix` is for grpo and online_ppo, not sft"):
        JobConfig.model_validate(raw)


def test_a_wrong_value_is_one_line_naming_the_key_and_the_override(tmp_path):
    from astrai.config import load_job

    job = tmp_path / "grpo.yaml"
    job.write_text(
        "output_dir: " + str(tmp_path / "out") + "\nmodel: {init: {model_type: llama, hidden_size: 32, "
        "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}}\n"
        "tokenizer: {build: {kind: char}}\ndata: {path: data/arithmetic/prompts_64.jsonl}\n"
        "rollout: {prompts_per_step: 2, group_size: 4}\n"
        "reward: {function: 'astrai.rollout.rewards:arithmetic_exact_match'}\n"
        "train: {train_type: grpo, max_steps: 1, micro_batch_size: 4, grad_accum_steps: 2}\n"
    )
    assert load_job(job, ["rl.share_prefix=true"]).rl.share_prefix is True
    with pytest.raises(ConfigError) as error:
        load_job(job, ["rl.share_prefix=maybe"])
    message = str(error.value).strip()
    assert "--set rl.share_prefix=maybe: rl.share_prefix:" in message and len(message.splitlines()) == 1, message
