"""`rm` in one process: the scalar head, the export's classifier scoring as the trained module does, the
critic started from it, `reward.normalize: stored`, and the bad inputs named before training."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.config import ConfigError
from astrai.config.schema import JobConfig, RewardConfig
from astrai.data import DataError
from astrai.data.sources import load_rows
from astrai.models.reward import (
    STATS_FILE,
    RewardModel,
    last_non_pad_positions,
    reward_stats_text,
    to_sequence_classifier,
)
from astrai.models.tokenizer import TokenizerError, set_pad_token
from astrai.models.value import load_value_model, trunk_of
from astrai.rollout.rewards import RewardError, build_reward
from astrai.strategies.reward_model import RewardModelStrategy
from tests.unit.rollout_fixtures import tiny_model, tiny_tokenizer

DEVICE = torch.device("cpu")
PAIRS = [
    {"prompt": "12+7=", "chosen": "19", "rejected": "18"},
    {"prompt": "3-5=", "chosen": "-2", "rejected": "2"},
    {"prompt": "40+40=", "chosen": "80", "rejected": "8"},
]


def rm_job(data_path, **sections) -> JobConfig:
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": {"model_type": "llama"}},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": str(data_path), "max_seq_len": 32},
        "train": {"train_type": "rm", "max_steps": 1},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return JobConfig.model_validate(raw)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def trained_like_reward_model(tokenizer) -> RewardModel:
    """A RewardModel whose head is not zero (as after training), so that scores differ between sequences."""
    model = RewardModel(trunk_of(tiny_model(tokenizer, seed=3)), tokenizer.pad_token_id)
    torch.manual_seed(4)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    return model.eval()


def test_last_non_pad_position_is_transformers_rule():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [0, 5, 0, 6, 0]])
    assert last_non_pad_positions(ids, 0).tolist() == [2, 4, 3]


def test_a_fresh_head_scores_zero_and_padding_does_not_change_a_score():
    tokenizer = tiny_tokenizer()
    fresh = RewardModel(trunk_of(tiny_model(tokenizer)), tokenizer.pad_token_id)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert fresh(ids).tolist() == [0.0]  # zero-initialised head: every first reward is exactly 0
    model = trained_like_reward_model(tokenizer)
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[5, 6, 7, 8], [5, 6, pad, pad]])
    with torch.no_grad():
        together = model(batch, (batch != pad).long()).tolist()
        alone = [float(model(ids)), float(model(torch.tensor([[5, 6]])))]
    assert together == pytest.approx(alone, abs=1e-6)


def test_export_is_a_plain_sequence_classifier_scoring_as_the_trained_module(tmp_path):
    """to_sequence_classifier -> save_pretrained -> `reward.model_path` (ModelReward, fp32) scores the rendered
    chat exactly as the RewardModel scores the ids rm trains on (max diff <= 1e-4)."""
    from transformers import AutoModelForSequenceClassification

    from astrai.data.render import preference_batch

    tokenizer = tiny_tokenizer()
    model = trained_like_reward_model(tokenizer)
    classifier = to_sequence_classifier(model, torch.float32)
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tokenizer.pad_token_id
    job = rm_job("unused.jsonl")
    columns = {key: [row[key] for row in PAIRS] for key in PAIRS[0]}
    rendered = preference_batch(
        columns, list(range(len(PAIRS))), tokenizer=tokenizer, fields=job.data, max_len=32, skip_bad=False
    )
    sequences = rendered["chosen_ids"] + rendered["rejected_ids"]
    with torch.no_grad():
        trained = torch.cat([model(torch.tensor([ids])) for ids in sequences])
    reward = build_reward(RewardConfig(model_path=str(tmp_path / "rm"), batch_size=4), DEVICE)
    inputs = {
        "messages": [[{"role": "user", "content": row["prompt"]}] for row in PAIRS] * 2,
        "responses": [row["chosen"] for row in PAIRS] + [row["rejected"] for row in PAIRS],
        "prompts": [""] * 6,
        "rows": PAIRS * 2,
    }
    scored = reward(inputs).total
    assert trained.abs().max() > 0.01  # the comparison is not between zeros
    assert (scored - trained).abs().max() <= 1e-4


def test_the_export_starts_the_critic_with_its_trunk_and_head(tmp_path):
    tokenizer = tiny_tokenizer()
    model = trained_like_reward_model(tokenizer)
    to_sequence_classifier(model, torch.float32).save_pretrained(tmp_path / "rm")
    critic = load_value_model(tmp_path / "rm")
    assert torch.equal(critic.value_head.weight, model.score.weight.detach())
    assert torch.equal(critic.value_head.bias, torch.zeros(1))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert critic(ids)[0, -1] == pytest.approx(float(model(ids)), abs=1e-5)  # the last value is the reward


def test_normalize_stored_standardises_with_the_exported_statistics(tmp_path):
    tokenizer = tiny_tokenizer()
    to_sequence_classifier(trained_like_reward_model(tokenizer), torch.float32).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    inputs = {"messages": [[{"role": "user", "content": "1+1="}]] * 2, "responses": ["2", "3"], "prompts": [""] * 2}
    raw = build_reward(RewardConfig(model_path=str(tmp_path / "rm")), DEVICE)(inputs).total
    stored = RewardConfig(model_path=str(tmp_path / "rm"), normalize="stored")
    with pytest.raises(RewardError, match=f"normalize stored: .*{STATS_FILE} does not exist"):
        build_reward(stored, DEVICE)
    (tmp_path / "rm" / STATS_FILE).write_text(reward_stats_text(0.5, 2.0, 3, "test"))
    assert build_reward(stored, DEVICE)(inputs).total.tolist() == pytest.approx(((raw - 0.5) / 2.0).tolist())
    (tmp_path / "rm" / STATS_FILE).write_text(reward_stats_text(0.5, 0.0, 3, "test"))
    with pytest.raises(RewardError, match="std > 0"):
        build_reward(stored, DEVICE)
    with pytest.raises(ValueError, match="model_path"):
        RewardConfig(function="astrai.rollout.rewards:arithmetic_exact_match", normalize="stored")


def test_a_reward_model_with_several_labels_is_refused_naming_num_labels(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=3,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "three")
    tokenizer.save_pretrained(tmp_path / "three")
    with pytest.raises(RewardError, match="num_labels 3"):
        build_reward(RewardConfig(model_path=str(tmp_path / "three")), DEVICE)


def test_a_tokenizer_without_its_own_pad_token_is_refused_naming_the_key(tmp_path):
    job = rm_job(tmp_path / "pairs.jsonl")
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # what AstrAI's loader does for a tokenizer without one
    with pytest.raises(ConfigError, match="`tokenizer.pad_token`"):
        RewardModelStrategy(job, tokenizer)
    tokenizer.pad_token = None
    with pytest.raises(ConfigError, match="`tokenizer.pad_token`"):
        RewardModelStrategy(job, tokenizer)
    explicit = rm_job(tmp_path / "pairs.jsonl", tokenizer={"pad_token": "<|im_end|>"})
    set_pad_token(tokenizer, "<|im_end|>")
    RewardModelStrategy(explicit, tokenizer)  # named explicitly: accepted (the data check below still runs)
    with pytest.raises(TokenizerError, match="tokenizer.pad_token: 'nope' is not a token"):
        set_pad_token(tokenizer, "nope")


def test_a_sequence_ending_with_the_pad_token_is_refused(tmp_path):
    path = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    job = rm_job(path, tokenizer={"pad_token": "\n"})  # ChatML ends every turn with "<|im_end|>\n"
    tokenizer = tiny_tokenizer()
    set_pad_token(tokenizer, "\n")
    strategy = RewardModelStrategy(job, tokenizer)
    with pytest.raises(ConfigError, match="ends with the pad token"):
        strategy.prepare_data(load_rows(str(path), "auto", tmp_path / "cache"))


@pytest.mark.parametrize("missing", ["chosen", "rejected"])
def test_rows_without_chosen_or_rejected_name_the_field_and_row(tmp_path, missing):
    rows = [dict(row) for row in PAIRS]
    del rows[2][missing]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    strategy = RewardModelStrategy(rm_job(path), tiny_tokenizer())
    with pytest.raises(DataError, match=rf"pairs.jsonl.*row 3.*'{missing}' must be a string"):
        strategy.prepare_data(load_rows(str(path), "auto", tmp_path / "cache"))


def test_margins_come_from_the_margin_field_and_a_missing_one_is_named(tmp_path):
    rows = [dict(row, strength=float(index)) for index, row in enumerate(PAIRS)]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    strategy = RewardModelStrategy(rm_job(path, rm={"margin_field": "strength"}), tiny_tokenizer())
    dataset, skipped = strategy.prepare_data(load_rows(str(path), "auto", tmp_path / "cache"))
    assert skipped == 0 and dataset["margin"] == [0.0, 1.0, 2.0]
    batch = strategy.collate([dataset[0], dataset[2]])
    assert batch["input_ids"].shape[0] == 4 and batch["margin"].tolist() == [0.0, 2.0]
    del rows[1]["strength"]
    path = write_rows(tmp_path / "bad.jsonl", rows)
    strategy = RewardModelStrategy(rm_job(path, rm={"margin_field": "strength"}), tiny_tokenizer())
    with pytest.raises(DataError, match=r"bad.jsonl.*row 2.*rm.margin_field 'strength' must be a finite number"):
        strategy.prepare_data(load_rows(str(path), "auto", tmp_path / "cache"))
    skipping = rm_job(path, rm={"margin_field": "strength"}, data={"on_bad_row": "skip"})
    dataset, skipped = RewardModelStrategy(skipping, tiny_tokenizer()).prepare_data(
        load_rows(str(path), "auto", tmp_path / "cache2", skip_bad=True)
    )
    assert skipped == 1 and dataset["margin"] == [0.0, 2.0]


def test_the_loss_of_a_micro_batch_is_the_bradley_terry_sum_over_the_normalizer(tmp_path):
    """compute_loss with a plain module: a zero head gives log 2 per pair; the margin enters the loss."""
    rows = [dict(row, strength=1.0) for row in PAIRS]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    tokenizer = tiny_tokenizer()
    strategy = RewardModelStrategy(rm_job(path, rm={"margin_field": "strength"}), tokenizer)
    dataset, _ = strategy.prepare_data(load_rows(str(path), "auto", tmp_path / "cache"))
    batch = strategy.collate([dataset[i] for i in range(3)])
    fresh = RewardModel(trunk_of(tiny_model(tokenizer)), tokenizer.pad_token_id)
    output = strategy.compute_loss(fresh, batch, normalizer=6.0)
    # every reward 0: each pair's loss is -log sigmoid(0 - 1) = log(1 + e) = 1.3132617
    assert float(output.loss.detach()) == pytest.approx(3 * 1.3132617 / 6.0, abs=1e-6)
    assert output.sums["loss"] == pytest.approx(3 * 1.3132617, abs=1e-6)
    assert output.sums["weight"] == 3.0 and output.sums["accuracy"] == 0.0 and output.sums["margin"] == 0.0
    assert set(output.sums) == {"loss", "accuracy", "chosen_reward", "rejected_reward", "margin", "weight"}
