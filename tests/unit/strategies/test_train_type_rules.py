"""Each train type's rules (astrai/train_types.py) belong to its strategy, and the schema, the planner and the
run read the same answers from them."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from astrai.config.schema import JobConfig, TrainConfig
from astrai.rollout.generation import generation_mode
from astrai.strategies import REGISTRY, strategy_class
from astrai.strategies.frozen_reference import reference_is_the_policy
from astrai.train_types import RULES, users_of

TINY = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}


def raw_job(train_type: str, **sections) -> dict:
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": dict(TINY, num_attention_heads=2)},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": "unused.jsonl"},
        "train": {"train_type": train_type, "max_steps": 3},
    }
    if RULES[train_type].online:
        raw.update(reward={"function": "unused:score"}, rollout={"group_size": 2})
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def test_every_strategy_names_its_own_rules_and_every_schema_name_has_both():
    accepted = set(typing.get_args(TrainConfig.model_fields["train_type"].annotation))
    assert set(REGISTRY) == set(RULES) == accepted
    for name, strategy in REGISTRY.items():
        assert strategy.rules is RULES[name]
        assert strategy.rules.online == (strategy.loop == "online")


def test_options_name_the_train_types_that_use_them():
    assert users_of("data.packing") == "sft and dpo"
    assert users_of("data.document_mask") == "seq"
    assert users_of("rl.share_prefix") == "grpo and online_ppo"
    assert users_of("rm.share_prefix") == "rm"


@pytest.mark.parametrize(
    "train_type, sections, message",
    [
        (
            "seq",
            {"data": {"packing": True}},
            "`data.packing` is for sft and dpo, not seq (seq blocks have no padding; `data.document_mask` isolates "
            "their documents)",
        ),
        ("grpo", {"data": {"packing": True}}, "`data.packing` is for sft and dpo, not grpo (use `rl.packing`)"),
        ("rm", {"data": {"packing": True}}, "`data.packing` is for sft and dpo, not rm (use `rl.packing`)"),
        ("sft", {"data": {"document_mask": True}}, "`data.document_mask` is for seq, not sft"),
        ("dpo", {"rl": {"packing": True}}, "`rl.packing` is for grpo and online_ppo, not dpo (use `data.packing`)"),
        ("sft", {"rl": {"share_prefix": True}}, "`rl.share_prefix` is for grpo and online_ppo, not sft"),
        (
            "grpo",
            {"rm": {"share_prefix": True}},
            "`rm.share_prefix` is for rm, not grpo (grpo and online_ppo: `rl.share_prefix`)",
        ),
        (
            "online_ppo",
            {"rl": {"advantage_estimator": "rloo"}},
            "`rl.advantage_estimator: rloo` is for `train.train_type: grpo`; online_ppo's advantages are GAE with "
            "its critic",
        ),
        (
            "online_ppo",
            {"rl": {"kl_in_reward": False, "kl_estimator": "k1"}},
            "`rl.kl_estimator: k1` as a loss term (`rl.kl_in_reward: false`) has zero expected gradient",
        ),
    ],
)
def test_section_rules_keep_their_messages(train_type, sections, message):
    with pytest.raises(ValidationError) as error:
        JobConfig.model_validate(raw_job(train_type, **sections))
    assert message in str(error.value)


@pytest.mark.parametrize(
    "train_type, sections, needs, keeps",
    [
        ("sft", {}, False, False),
        ("rm", {}, False, False),
        ("dpo", {}, True, True),
        ("dpo", {"dpo": {"precompute_reference": True}}, True, False),  # scored once, freed before training
        ("dpo", {"dpo": {"loss": "simpo"}}, False, False),  # reference-free: never built
        ("grpo", {}, True, True),
        ("grpo", {"rl": {"kl_coef": 0.0}}, False, False),
        ("online_ppo", {"rl": {"kl_coef": 0.0}}, False, False),
    ],
)
def test_reference_answers(train_type, sections, needs, keeps):
    job = JobConfig.model_validate(raw_job(train_type, **sections))
    strategy = strategy_class(train_type)
    assert (strategy.needs_reference(job), strategy.keeps_reference(job)) == (needs, keeps)


def test_a_lora_policy_is_its_own_reference_and_samples_in_place():
    job = JobConfig.model_validate(raw_job("grpo", model={"lora": {"r": 2}}))
    assert reference_is_the_policy(job)
    assert not reference_is_the_policy(job.model_copy(update={"model": job.model.model_copy(update={"lora": None})}))
    assert generation_mode("copy", lora=True) == "gather"
    assert generation_mode("copy", lora=False) == "copy" and generation_mode("gather", lora=False) == "gather"


@pytest.mark.parametrize(
    "train_type, rl, warned",
    [
        ("grpo", {"advantage_estimator": "reinforce_pp", "kl_coef": 0.1, "kl_estimator": "k3"}, True),
        ("grpo", {"advantage_estimator": "reinforce_pp", "kl_coef": 0.1, "kl_estimator": "k2"}, True),
        ("grpo", {"advantage_estimator": "reinforce_pp", "kl_coef": 0.1, "kl_estimator": "k1"}, False),
        ("grpo", {"advantage_estimator": "reinforce_pp", "kl_coef": 0.1}, False),  # the default there is k1
        ("grpo", {"advantage_estimator": "reinforce_pp", "kl_coef": 0.0, "kl_estimator": "k3"}, False),  # no KL
        ("grpo", {"kl_coef": 0.1, "kl_estimator": "k3"}, False),  # grpo: a loss term, where k3 is right
        ("online_ppo", {"kl_in_reward": True, "kl_coef": 0.1, "kl_estimator": "k3"}, True),
        ("online_ppo", {"kl_in_reward": False, "kl_coef": 0.1, "kl_estimator": "k3"}, False),
    ],
)
def test_a_k2_or_k3_penalty_in_the_reward_is_warned(train_type, rl, warned):
    """Only k1 in the reward gives the KL's gradient (E[grad log pi x log(pi/ref)] = grad KL); k2 or k3 there
    is biased, so the job is warned, naming the key (and run: the estimator is the user's choice)."""
    job = JobConfig.model_validate(raw_job(train_type, rl=rl))
    warnings = strategy_class(train_type).rules.warnings(job)
    assert len(warnings) == int(warned)
    if warned:
        assert warnings[0].startswith(f"rl.kl_estimator: {rl['kl_estimator']} with the KL in the reward")
