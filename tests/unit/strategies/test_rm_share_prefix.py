"""`rm.share_prefix` in one process: each distinct prompt of a micro-batch runs once and the chosen and rejected
completions against its keys and values, with the plain forward's loss, metrics and gradients; a model that
cannot share a cache takes one plain forward of the split rows; the key is refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from astrai.config import ConfigError, load_job
from astrai.data.sources import load_rows
from astrai.models.reward import RewardModel
from astrai.models.value import trunk_of
from astrai.strategies.reward_model import RewardModelStrategy
from tests.conftest import REPO
from tests.unit.rollout_fixtures import LLAMA_SHAPE, tiny_model, tiny_tokenizer
from tests.unit.strategies.test_reward_model import PAIRS, rm_job, trained_like_reward_model, write_rows

# A prompt twice (with two different wrong answers), so that a micro-batch holds 3 distinct prompts in 4 pairs.
ROWS = [dict(row, strength=float(index)) for index, row in enumerate(PAIRS)] + [
    {"prompt": "12+7=", "chosen": "19", "rejected": "29", "strength": 0.5}
]


SIDES = ("chosen", "rejected")


def strategies(tmp_path, tokenizer):
    path = write_rows(tmp_path / "pairs.jsonl", ROWS)
    rows = load_rows(str(path), "auto", tmp_path / "cache")
    built = {}
    for shared in (False, True):
        job = rm_job(path, rm={"margin_field": "strength", "center_rewards_coef": 0.01, "share_prefix": shared})
        strategy = RewardModelStrategy(job, tokenizer)
        dataset, _ = strategy.prepare_data(rows)
        built[shared] = strategy, [dataset[index] for index in range(len(dataset))]
    return built


def loss_and_gradients(strategy, model, rows):
    model.zero_grad()
    output = strategy.compute_loss(model, strategy.collate(rows), normalizer=float(len(rows)))
    output.loss.backward()
    return output, [parameter.grad.clone() for parameter in model.parameters()]


def test_the_shared_prompt_forward_gives_the_plain_loss_metrics_and_gradients(tmp_path):
    tokenizer = tiny_tokenizer()
    built = strategies(tmp_path, tokenizer)
    model = trained_like_reward_model(tokenizer).train()
    embedded = []
    model.trunk.embed_tokens.register_forward_hook(lambda module, args, out: embedded.append(tuple(args[0].shape)))
    plain_rows, shared_rows = built[False][1], built[True][1]
    plain, plain_grads = loss_and_gradients(built[False][0], model, plain_rows)
    longest = max(len(row[column]) for row in plain_rows for column in ("chosen_ids", "rejected_ids"))
    assert embedded == [(8, longest)]  # 4 pairs: every prompt twice
    embedded.clear()
    shared, shared_grads = loss_and_gradients(built[True][0], model, shared_rows)
    # the 3 distinct prompts once (4 pairs, 8 sequences), then the 8 completions' columns against their keys
    splits = [(row[f"{name}_mask"].index(1), len(row[f"{name}_ids"])) for row in shared_rows for name in SIDES]
    assert embedded == [(3, max(start for start, _ in splits)), (8, max(end - start for start, end in splits))]
    assert float(shared.loss.detach()) == pytest.approx(float(plain.loss.detach()), abs=1e-6)
    assert shared.sums == pytest.approx(plain.sums, abs=1e-5)
    assert plain.sums["accuracy"] not in (0.0, 4.0)  # the head is random: both outcomes occur, so ranks are compared
    for grad, reference in zip(shared_grads, plain_grads):
        assert grad.abs().sum() > 0
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def test_a_model_that_cannot_share_a_cache_takes_one_plain_forward_of_the_split_rows(tmp_path):
    from transformers import MistralConfig, MistralModel

    tokenizer = tiny_tokenizer()
    built = strategies(tmp_path, tokenizer)
    config = MistralConfig(
        vocab_size=len(tokenizer), **LLAMA_SHAPE, sliding_window=4, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(5)
    model = RewardModel(MistralModel(config), tokenizer.pad_token_id)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    embedded = []
    model.trunk.embed_tokens.register_forward_hook(lambda module, args, out: embedded.append(tuple(args[0].shape)))
    with torch.no_grad():
        plain = built[False][0].compute_loss(model, built[False][0].collate(built[False][1]), normalizer=4.0)
        split = built[True][0].collate(built[True][1])
        shared = built[True][0].compute_loss(model, split, normalizer=4.0)
    assert len(embedded) == 2 and embedded[1] == tuple(split["input_ids"].shape)  # one forward, left-padded rows
    assert shared.sums == pytest.approx(plain.sums, abs=1e-5)
    assert float(shared.loss.detach()) == pytest.approx(float(plain.loss.detach()), abs=1e-6)


def test_a_fresh_head_scores_zero_on_the_shared_path(tmp_path):
    """A fresh (zero) head scores 0 for every completion: the step-1 loss is softplus of each margin, exactly."""
    tokenizer = tiny_tokenizer()
    built = strategies(tmp_path, tokenizer)
    fresh = RewardModel(trunk_of(tiny_model(tokenizer)), tokenizer.pad_token_id).eval()
    with torch.no_grad():
        output = built[True][0].compute_loss(fresh, built[True][0].collate(built[True][1]), normalizer=4.0)
    margins = [row["strength"] for row in ROWS]
    expected = sum(float(torch.nn.functional.softplus(torch.tensor(margin))) for margin in margins)
    assert output.sums["loss"] == pytest.approx(expected, abs=1e-6) and output.sums["chosen_reward"] == 0.0


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"train": {"train_type": "dpo"}},
            r"`rm.share_prefix` is for rm, not dpo \(grpo and online_ppo: `rl.share_prefix`\)",
        ),
        ({"model": {"gradient_checkpointing": True}}, r"`rm.share_prefix` with `model.gradient_checkpointing`"),
    ],
)
def test_the_key_is_refused_where_it_cannot_apply(sections, message):
    assert rm_job("pairs.jsonl", rm={"share_prefix": True}).rm.share_prefix is True
    with pytest.raises(ValueError, match=message):
        rm_job("pairs.jsonl", rm={"share_prefix": True}, **sections)


def test_a_wrong_value_is_one_line_naming_the_key_and_the_override():
    """Checked where the job file is read, before any rank starts."""
    config = REPO / "configs/quickstart_rm.yaml"
    assert load_job(config, ["rm.share_prefix=false"], check_paths=False).rm.share_prefix is False
    with pytest.raises(ConfigError) as error:
        load_job(config, ["rm.share_prefix=maybe"], check_paths=False)
    message = str(error.value).strip()
    assert "--set rm.share_prefix=maybe: rm.share_prefix:" in message and len(message.splitlines()) == 1, message
