"""`rm`: a reward model trained on preference pairs with the Bradley-Terry loss (algos/reward_model.py).

The data is dpo's: (prompt or messages, chosen, rejected) rows rendered with the chat template, plus an
optional per-pair margin (`rm.margin_field`). The trained module is `models.reward.RewardModel`: the
policy's trunk (built exactly as the policy: `model.path` / `model.init`) and a scalar head read at the
last non-pad token. Each micro-batch holds B pairs, scored as one forward of 2B sequences (chosen, then
rejected); the step's loss is the mean over its pairs (the loop divides by the global pair count).

Metric sums per micro-batch are dpo's shape (sums over pairs, `weight` = pairs), named as TRL's
RewardTrainer and OpenRLHF log them: `loss`, `accuracy` (r_c > r_r), `chosen_reward`, `rejected_reward`,
`margin` (r_c - r_r, without the data's margin).

The score is read at the last token that is not the pad token, so a pad token is required and may not
end a rendered sequence: both are checked before any training (`check_pad_token`).
"""

from __future__ import annotations

import glob
import logging
import math
from functools import partial

import datasets
import torch

from astrai.algos.reward_model import bradley_terry_loss
from astrai.config import ConfigError
from astrai.data import render_rows
from astrai.data.collate import pad_right
from astrai.data.render import RowError, preference_batch
from astrai.strategies.base import StepOutput, Strategy, register

logger = logging.getLogger("astrai.rm")


def reward_pair_batch(batch: dict[str, list], indices: list[int], *, margin_field: str | None, **options):
    """`datasets.map` function: dpo's `preference_batch`, plus each pair's `margin` (0.0 without a
    margin field). A row whose margin is missing or not a finite number is bad like any malformed row."""
    out = preference_batch(batch, indices, **options)
    margins = []
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    for row, index, bad in zip(rows, indices, out["bad"]):
        value = 0.0 if margin_field is None else row.get(margin_field)
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not valid and not bad:
            if not options["skip_bad"]:
                raise RowError(index, f"rm.margin_field {margin_field!r} must be a finite number, got {value!r}")
            out["bad"][len(margins)] = True
        margins.append(float(value) if valid else 0.0)
    out["margin"] = margins
    return out


def check_pad_token(tokenizer, job) -> None:
    """The scalar head reads the last token that is not the pad token: refuse a tokenizer without a pad
    token of its own (AstrAI's loader falls back to EOS, which would hide a trailing EOS from the head),
    unless `tokenizer.pad_token` names one explicitly."""
    explicit = getattr(job.tokenizer, "pad_token", None) is not None
    if tokenizer.pad_token_id is None or (not explicit and tokenizer.pad_token_id == tokenizer.eos_token_id):
        raise ConfigError(
            "train.train_type rm: the tokenizer has no pad token of its own (unset, or falling back to the EOS "
            f"token {tokenizer.eos_token!r}); the reward head reads the last non-pad token: set `tokenizer.pad_token` "
            "to a token of the vocabulary that never ends a sequence"
        )


@register
class RewardModelStrategy(Strategy):
    name = "rm"
    loop = "offline"

    def __init__(self, job, tokenizer):
        super().__init__(job, tokenizer)
        check_pad_token(tokenizer, job)

    @classmethod
    def policy_module(cls, model, tokenizer):
        """The trainable module: the causal LM's trunk under a scalar head (models/reward.py)."""
        from astrai.models.reward import RewardModel
        from astrai.models.value import trunk_of

        return RewardModel(trunk_of(model), tokenizer.pad_token_id)

    def prepare_data(self, rows) -> tuple[datasets.Dataset, int]:
        dataset, skipped = render_rows(
            rows,
            self._batch_function(),
            tokenizer=self.tokenizer,
            data=self.job.data,
            description="rendering reward-model pairs",
        )
        self._check_last_tokens(dataset)
        return dataset, skipped

    def _batch_function(self):
        return partial(reward_pair_batch, margin_field=self.job.rm.margin_field)

    def _check_last_tokens(self, dataset: datasets.Dataset) -> None:
        pad = self.tokenizer.pad_token_id
        for column in ("chosen_ids", "rejected_ids"):
            for position, ids in enumerate(dataset[column]):
                if ids and ids[-1] == pad:
                    raise ConfigError(
                        f"train.train_type rm: pair {position}'s {column.split('_')[0]} sequence ends with the pad "
                        f"token {self.tokenizer.pad_token!r}, so the reward head could not read its last token: set "
                        "`tokenizer.pad_token` to a token that never ends a sequence"
                    )

    def collate(self, rows: list[dict]) -> dict:
        """[2B, T]: the B chosen sequences, then the B rejected ones; `margin` [B]."""
        sequences = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
        return {
            "input_ids": pad_right(sequences, self.tokenizer.pad_token_id),
            "attention_mask": pad_right([[1] * len(sequence) for sequence in sequences], 0),
            "margin": torch.tensor([row["margin"] for row in rows], dtype=torch.float32),
        }

    def loss_weight(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        pairs = batch["input_ids"].shape[0] // 2
        rewards = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        margin = batch["margin"] if self.job.rm.margin_field is not None else None
        result = bradley_terry_loss(chosen, rejected, margin, self.job.rm.center_rewards_coef)
        sums = {
            "loss": float(result.losses.detach().sum()),
            "accuracy": float(result.accuracy.sum()),
            "chosen_reward": float(chosen.detach().sum()),
            "rejected_reward": float(rejected.detach().sum()),
            "margin": float(result.margins.sum()),
            "weight": float(pairs),
        }
        return StepOutput(result.losses.sum() / normalizer, sums)


@torch.no_grad()
def training_reward_statistics(job, classifier, tokenizer, batch_size: int = 64) -> tuple[float, float, int]:
    """(mean, std, pairs): the reward of every chosen and rejected sequence of the job's training pairs, rendered
    as training rendered them and scored by `classifier` (a float32 transformers sequence classifier)."""
    import tempfile
    from pathlib import Path

    from astrai.data.sources import load_rows

    with tempfile.TemporaryDirectory(prefix="astrai-reward-stats-") as cache:
        rows = load_rows(job.data.path, job.data.format, Path(cache), skip_bad=job.data.on_bad_row == "skip")
        dataset, _ = render_rows(
            rows,
            partial(reward_pair_batch, margin_field=job.rm.margin_field),
            tokenizer=tokenizer,
            data=job.data.model_copy(update={"num_proc": 1}),
            description="scoring the training pairs",
        )
        sequences = list(dataset["chosen_ids"]) + list(dataset["rejected_ids"])
    rewards = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        input_ids = pad_right(chunk, tokenizer.pad_token_id)
        attention_mask = pad_right([[1] * len(sequence) for sequence in chunk], 0)
        rewards.append(classifier(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].double())
    values = torch.cat(rewards)
    std = float(values.std()) if values.numel() > 1 else 0.0
    return float(values.mean()), std, len(dataset)


def export_classifier(reward_model, job, tokenizer):
    """`export-hf` of an rm checkpoint: (the transformers sequence classifier holding `reward_model`'s weights,
    a function that adds reward_stats.json to the written folder).

    The statistics are measured at export, on the written folder loaded back in float32 as
    `reward.model_path` loads it, rather than tracked during training: a running mean over the steps would mix
    the rewards of every earlier version of the model (biased while it learns fast), and the loop stays
    untouched. The cost is one forward pass over the training pairs on the exporting process. Without the
    training data here the file is left out, with a warning (`reward.normalize: stored` then refuses the
    folder, naming the missing file)."""
    from pathlib import Path

    from astrai.models.reward import STATS_FILE, reward_stats_text, to_sequence_classifier

    classifier = to_sequence_classifier(reward_model, next(reward_model.parameters()).dtype)

    def add_statistics(folder: Path) -> None:
        from transformers import AutoModelForSequenceClassification

        if not glob.glob(job.data.path):
            logger.warning("no %s in the export: the training data %s is not here", STATS_FILE, job.data.path)
            return
        written = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        mean, std, pairs = training_reward_statistics(job, written, tokenizer)
        logger.info("reward over %d training pairs: mean %.4f, std %.4f", pairs, mean, std)
        source = f"training pairs of {job.data.path}"
        (folder / STATS_FILE).write_text(reward_stats_text(mean, std, pairs, source))

    return classifier, add_statistics
