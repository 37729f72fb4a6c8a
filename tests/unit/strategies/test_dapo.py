"""DAPO's pieces in-process: the overlong penalty and the group filter by hand, the group planner, groups cut
and re-padded across rollouts, mask_truncated, dynamic sampling's rounds on one rank, and the config checks.
(Groups dealt across ranks, determinism and resume: tests/integration/test_dapo_ranks.py.)"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from astrai.algos.dapo import informative_groups, overlong_penalty
from astrai.config import ConfigError
from astrai.config.schema import JobConfig
from astrai.engine import DistInfo
from astrai.rollout.generation import RolloutResult, generate_rollout, sampling_seed
from astrai.rollout.groups import concatenate_rollouts, select_groups
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.strategies.dynamic_sampling import deal_groups, plan_groups
from astrai.strategies.grpo import GrpoStrategy
from astrai.strategies.online_base import batch_geometry, round_seed
from tests.conftest import REPO
from tests.unit.rollout_fixtures import PlainEngine, behaviour_scoring, online_job, tiny_model, tiny_tokenizer


def job(**sections) -> JobConfig:
    return online_job("grpo", {"model_type": "llama"}, **sections)


# ----------------------------------------------------------------------------- pure math


def test_overlong_penalty_by_hand():
    """L_max 8, L_cache 4: 0 up to 4 tokens, then -(|y| - 4) / 4, -1 at 8 and beyond (DAPO eq. 13)."""
    lengths = torch.tensor([0, 2, 4, 5, 6, 7, 8, 9])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, max_tokens=8, buffer_tokens=4), expected)
    assert torch.equal(overlong_penalty(lengths, max_tokens=8, buffer_tokens=4, penalty_factor=0.5), expected * 0.5)
    # buffer = max_tokens: every token costs 1 / max_tokens (the penalty starts at the first token)
    third = overlong_penalty(torch.tensor([1, 3]), max_tokens=3, buffer_tokens=3)
    assert torch.allclose(third, torch.tensor([-1 / 3, -1.0]))
    with pytest.raises(ValueError, match="buffer_tokens 5, max_tokens 4"):
        overlong_penalty(lengths, max_tokens=4, buffer_tokens=5)


def test_informative_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5000001])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="multiple of 5"):
        informative_groups(rewards, 5)


def test_plan_groups_keeps_the_first_informative_groups_in_sampling_order():
    # informative[round][rank][group]
    flags = [[[False, True], [True, False]], [[True, True], [False, True]]]
    assert plan_groups(flags, 2) == [(0, 0, 1), (0, 1, 0)]  # the first round suffices: round 1 is surplus
    assert plan_groups(flags, 4) == [(0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1)]  # (1, 1, 1) dropped
    # Too few informative groups: the uninformative ones fill the step, in the same order.
    assert plan_groups([[[False, True], [False, False]]], 4) == [(0, 0, 1), (0, 0, 0), (0, 1, 0), (0, 1, 1)]


# ----------------------------------------------------------------------------- groups across rollouts


def hand_rollout(
    prompts: list[list[int]], responses: list[list[int]], *, group_size: int, tag: str, pad: int = 0
) -> RolloutResult:
    """A rollout built by hand: prompts left-padded, responses right-padded with `pad` (ids >= 1 are tokens)."""
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[pad] * (prompt_width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (prompt_width - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor([r + [pad] * (response_width - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (response_width - len(r)) for r in responses])
    count = len(prompts)
    return RolloutResult(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=-response_mask.float() * 0.5,
        truncated=torch.zeros(count, dtype=torch.bool),
        prompt_texts=[f"{tag}p{i}" for i in range(count)],
        response_texts=[f"{tag}r{i}" for i in range(count)],
        messages=[[] for _ in range(count)],
        rows=[{"row": f"{tag}{i}"} for i in range(count)],
        group_size=group_size,
        policy_version=3,
        rewards=torch.arange(count, dtype=torch.float32),
    )


def test_groups_cut_and_joined_are_re_padded():
    first = hand_rollout([[5], [5], [6, 7], [6, 7]], [[1, 2, 3], [1], [4], [4, 4]], group_size=2, tag="a")
    second = hand_rollout([[8, 8, 8], [8, 8, 8]], [[9], [9]], group_size=2, tag="b")
    parts = [select_groups(first, [1]), select_groups(second, [0]), select_groups(first, [0])]
    joined = concatenate_rollouts(parts, pad_token_id=0)
    assert joined.prompt_ids.tolist() == [[0, 6, 7], [0, 6, 7], [8, 8, 8], [8, 8, 8], [0, 0, 5], [0, 0, 5]]
    assert joined.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert joined.response_ids.tolist() == [[4, 0, 0], [4, 4, 0], [9, 0, 0], [9, 0, 0], [1, 2, 3], [1, 0, 0]]
    assert joined.response_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert joined.behaviour_logprobs.tolist() == (-joined.response_mask.float() * 0.5).tolist()
    assert joined.rewards.tolist() == [2.0, 3.0, 0.0, 1.0, 0.0, 1.0]
    assert joined.rows == [{"row": "a2"}, {"row": "a3"}, {"row": "b0"}, {"row": "b1"}, {"row": "a0"}, {"row": "a1"}]
    assert joined.response_texts[2:4] == ["br0", "br1"] and joined.group_size == 2 and joined.policy_version == 3
    # The joined layout is the one generation makes: positions count attended tokens only.
    tensors = joined.training_tensors()
    assert tensors["position_ids"][0].tolist() == [0, 0, 1, 2, 2, 2]


def test_deal_groups_on_one_rank_takes_the_picks_in_order():
    rounds = [
        hand_rollout([[5]] * 4, [[1]] * 4, group_size=2, tag="a"),
        hand_rollout([[6]] * 4, [[2, 2]] * 4, group_size=2, tag="b"),
    ]
    dealt = deal_groups(rounds, [(1, 0, 1), (0, 0, 0)], rank=0, per_rank=2, pad_token_id=0)
    assert dealt.rows == [{"row": "b2"}, {"row": "b3"}, {"row": "a0"}, {"row": "a1"}]
    assert dealt.response_ids.tolist() == [[2, 2], [2, 2], [1, 0], [1, 0]]


def test_mask_truncated_empties_the_loss_mask_only():
    rollout = hand_rollout([[5], [5]], [[1, 2], [3, 4]], group_size=2, tag="a")
    rollout.truncated = torch.tensor([True, False])
    rollout.loss_rows = ~rollout.truncated
    tensors = rollout.training_tensors()
    assert tensors["response_mask"].tolist() == [[0, 0], [1, 1]]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]  # attention unchanged
    assert rollout.metric_sums()["rollout/response_tokens"] == 4.0  # lengths still count every token


# ----------------------------------------------------------------------------- the strategy on one rank


class PositionReward:
    """Per group of 4: rows with mode `vary` score 1 on their group's first response and 0 on the others
    (informative); rows with mode `flat` score 0.5 on all (not)."""

    name = "position"

    def __call__(self, inputs):
        scores = []
        for position, row in enumerate(inputs["rows"]):
            scores.append(0.5 if row["mode"] == "flat" else float(position % 4 == 0))
        return scores


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def one_rank_strategy(config: JobConfig, tokenizer):
    strategy = GrpoStrategy(config, tokenizer)
    strategy.geometry = batch_geometry(config, 1)
    strategy.dist = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    strategy.reward = WeightedReward([(PositionReward(), 1.0)])
    strategy.reference = None
    return strategy


def prompt_rounds(tokenizer, modes: list[list[str]]):
    """One list of prepared examples per round, as `run.data.batches()` yields them."""
    import json

    for round_index, round_modes in enumerate(modes):
        examples = []
        for index, mode in enumerate(round_modes):
            chat = [{"role": "user", "content": f"{round_index}+{index}="}]
            row = {"mode": mode, "id": f"{round_index}.{index}"}
            prompt_ids = render_prompt(tokenizer, chat)
            examples.append({"prompt_ids": prompt_ids, "messages": json.dumps(chat), "row": json.dumps(row)})
        yield examples


def test_dynamic_sampling_rounds_keep_informative_groups(tokenizer):
    config = job(rl={"dynamic_sampling": True, "max_sampling_rounds": 3})
    strategy = one_rank_strategy(config, tokenizer)
    policy = PlainEngine(tiny_model(tokenizer))
    batches = prompt_rounds(tokenizer, [["flat", "vary"], ["flat", "flat"], ["vary", "vary"], ["vary", "vary"]])
    sample = strategy.sample(policy, batches, step=1, policy_version=0)
    # Round 0 gives one informative group, round 1 none, round 2 two: the step stops there (round 3 untouched).
    assert sample.prompts_drawn == 3 * 2
    assert sample.metrics == {
        "sampling_rounds": 3.0,
        "kept_groups": 2.0,
        "dropped_groups": 4.0,
        "sampled_reward_mean": pytest.approx(9 / 24),
    }
    assert [row["id"] for row in sample.rollout.rows[::4]] == ["0.1", "2.0"]
    assert sample.rollout.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] * 2
    targets = strategy.frozen_targets(sample.rollout)  # the rollout is scored once, in sampling
    assert targets["advantages"].abs().sum() > 0 and targets["input_ids"].shape[0] == 8
    # Round 2's responses are its own draw: another seed than round 0 of the same step.
    assert round_seed(7, 1, 0, 0) == sampling_seed(7, 1, 0)
    assert round_seed(7, 1, 0, 2) not in (sampling_seed(7, 1, 0), sampling_seed(7, 1, 0, 2))


def test_dynamic_sampling_fills_the_step_after_the_last_round(tokenizer):
    strategy = one_rank_strategy(job(rl={"dynamic_sampling": True, "max_sampling_rounds": 2}), tokenizer)
    batches = prompt_rounds(tokenizer, [["flat", "flat"], ["flat", "vary"]])
    sample = strategy.sample(PlainEngine(tiny_model(tokenizer)), batches, step=5, policy_version=0)
    assert sample.prompts_drawn == 4
    assert sample.metrics["kept_groups"] == 1.0 and sample.metrics["dropped_groups"] == 2.0
    # the informative group, then the first flat one
    assert [row["id"] for row in sample.rollout.rows[::4]] == ["1.1", "0.0"]
    assert strategy.frozen_targets(sample.rollout)["advantages"][4:].abs().sum() == 0


def test_overlong_penalty_and_mask_truncated_in_the_rollout(tokenizer):
    config = job(rl={"overlong_penalty": {"buffer_tokens": 2, "max_tokens": 5}, "mask_truncated": True})
    strategy = one_rank_strategy(config, tokenizer)
    batches = prompt_rounds(tokenizer, [["flat", "vary"]])
    sample = strategy.sample(PlainEngine(tiny_model(tokenizer)), batches, step=1, policy_version=0)
    rollout = sample.rollout
    lengths = rollout.response_mask.sum(1).float()
    penalty = -((lengths - 3).clamp(min=0) / 2).clamp(max=1)
    assert torch.equal(rollout.overlong_penalties, penalty) and (penalty < 0).any()
    assert torch.allclose(rollout.rewards, torch.tensor(PositionReward()({"rows": rollout.rows})) + penalty)
    assert rollout.metric_sums()["rollout/overlong_penalty"] == pytest.approx(float(penalty.sum()))
    assert rollout.truncated.any()  # a random tiny model rarely says EOS within 5 tokens
    mask = rollout.training_tensors()["response_mask"]
    truncated = rollout.truncated
    assert mask[truncated].sum() == 0 and torch.equal(mask[~truncated], rollout.response_mask[~truncated])


def test_without_dynamic_sampling_a_step_samples_what_it_did(tokenizer):
    config = job()
    strategy = one_rank_strategy(config, tokenizer)
    policy = PlainEngine(tiny_model(tokenizer))
    examples = next(prompt_rounds(tokenizer, [["flat", "vary"]]))
    sample = strategy.sample(policy, iter([examples]), step=4, policy_version=0)
    from astrai.rollout.prompts import decode_prompt_row

    prompt_ids, messages, rows = zip(*(decode_prompt_row(example) for example in examples))
    direct = generate_rollout(
        policy,
        tokenizer,
        Prompts(prompt_ids, messages, rows),
        config.rollout,
        seed=sampling_seed(config.train.seed, 4, 0),
        scoring=behaviour_scoring(config.rollout, tokenizer, 2) if strategy.needs_behaviour_logprobs() else None,
    )
    assert torch.equal(sample.rollout.response_ids, direct.response_ids)
    assert sample.prompts_drawn == 2 and sample.metrics == {}


# ----------------------------------------------------------------------------- configuration


def test_overlong_buffer_larger_than_max_tokens_fails_in_the_schema():
    message = r"`rl.overlong_penalty.buffer_tokens` \(6\) is larger than `rl.overlong_penalty.max_tokens` \(4\)"
    with pytest.raises(ValidationError, match=message):
        job(rl={"overlong_penalty": {"buffer_tokens": 6, "max_tokens": 4}})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"train": {"train_type": "online_ppo"}, "rl": {"dynamic_sampling": True}},
            "rl.dynamic_sampling needs train.train_type grpo, not online_ppo",
        ),
        (
            {
                "train": {"train_type": "online_ppo"},
                "rollout": {"group_size": 1, "prompts_per_step": 4},
                "rl": {"dynamic_sampling": True},
            },
            "rl.dynamic_sampling needs train.train_type grpo",
        ),
        (
            {"rl": {"overlong_penalty": {"buffer_tokens": 2, "max_tokens": 9}}},
            r"rl.overlong_penalty.max_tokens 9 > rollout.max_new_tokens 5",
        ),
        (
            {"rl": {"overlong_penalty": {"buffer_tokens": 6}}},
            r"rl.overlong_penalty.buffer_tokens 6 > rl.overlong_penalty.max_tokens 5 \(rollout.max_new_tokens\)",
        ),
    ],
)
def test_combinations_that_cannot_work_fail_before_any_rank(changes, message, tmp_path, monkeypatch):
    """Through astrai/train.py's pre-rank check: a ConfigError naming the job file and the keys."""
    import yaml

    from astrai.launch.job_checks import load_and_check

    path = tmp_path / "job.yaml"
    raw = job(**changes).model_dump(mode="json", exclude_none=True)
    raw["data"]["path"] = str(REPO / "data/arithmetic/prompts_64.jsonl")
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=rf"job\.yaml: {message}"):
        load_and_check(str(path), [])
