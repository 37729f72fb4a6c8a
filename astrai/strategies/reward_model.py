"""`rm`: a reward model trained on preference pairs with the Bradley-Terry loss (algos/reward_model.py).

The data is dpo's: (prompt or messages, chosen, rejected) rows rendered with the chat template, plus an
optional per-pair margin (`rm.margin_field`). The trained module is `models.reward.RewardModel`: the
policy's trunk (built exactly as the policy: `model.path` / `model.init`) and a scalar head read at the
last non-pad token. Each micro-batch holds B pairs, scored as one forward of 2B sequences (chosen, then
rejected); the step's loss is the mean over its pairs (the loop divides by the global pair count). With
`rm.share_prefix` the forward runs each distinct prompt of the micro-batch once (a pair's chosen and rejected
completions share it) and the completions against its keys and values: the same rewards within float rounding
for a fraction of the tokens when prompts are long and completions short.

Metric sums per micro-batch are dpo's shape (sums over pairs, `weight` = pairs), named as TRL's
RewardTrainer and OpenRLHF log them: `loss`, `accuracy` (r_c > r_r), `chosen_reward`, `rejected_reward`,
`margin` (r_c - r_r, without the data's margin).

The score is read at the last token that is not the pad token, so a pad token is required and may not
end a rendered sequence: both are checked before any training (`check_pad_token`).
"""

from __future__ import annotations

import logging
from functools import partial

import datasets
import torch

from astrai.algos.reward_model import bradley_terry_loss
from astrai.config import ConfigError
from astrai.data import render_rows
from astrai.data.collate import pad_right
from astrai.data.reward_pairs import reward_pair_batch
from astrai.models.reward import last_non_pad_positions
from astrai.models.token_forward import SequenceShards, TokenForward
from astrai.rollout.prefix_scoring import shared_prompt_inputs, shares_prompt
from astrai.rollout.sequences import join_sequences, left_pad
from astrai.strategies.base import StepOutput, Strategy, register
from astrai.train_types import RmRules

logger = logging.getLogger("astrai.rm")


def check_pad_token(tokenizer, job) -> None:
    """The scalar head reads the last token that is not the pad token: refuse a tokenizer without a pad
    token of its own (AstrAI's loader falls back to EOS, which would hide a trailing EOS from the head),
    unless `tokenizer.pad_token` names one explicitly."""
    explicit = job.tokenizer.pad_token is not None
    if tokenizer.pad_token_id is None or (not explicit and tokenizer.pad_token_id == tokenizer.eos_token_id):
        raise ConfigError(
            "train.train_type rm: the tokenizer has no pad token of its own (unset, or falling back to the EOS "
            f"token {tokenizer.eos_token!r}); the reward head reads the last non-pad token: set `tokenizer.pad_token` "
            "to a token of the vocabulary that never ends a sequence"
        )


@register
class RewardModelStrategy(Strategy):
    name = "rm"
    rules = RmRules
    loop = "offline"
    sequences_per_row = 2  # chosen and rejected
    # Held-out figures (eval/<name>): the default eval_metrics divides these sums by the pairs they cover.
    eval_metric_names = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")

    def __init__(self, job, tokenizer):
        super().__init__(job, tokenizer)
        check_pad_token(tokenizer, job)

    @classmethod
    def policy_module(cls, model, tokenizer):
        """The trainable module: the causal LM's trunk under a scalar head (models/reward.py)."""
        from astrai.models.reward import reward_model_of

        return reward_model_of(model, tokenizer)

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
        """[2B, T]: the B chosen sequences, then the B rejected ones; `margin` [B]. With `rm.share_prefix`
        each sequence is split at its completion: the prompt left-padded, the completion right-padded
        (`join_sequences`' layout, with position_ids and response_ids)."""
        margin = torch.tensor([row["margin"] for row in rows], dtype=torch.float32)
        sequences = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
        pad = self.tokenizer.pad_token_id
        if not self.job.rm.share_prefix:
            return {
                "input_ids": pad_right(sequences, pad),
                "attention_mask": pad_right([[1] * len(sequence) for sequence in sequences], 0),
                "margin": margin,
            }
        masks = [row["chosen_mask"] for row in rows] + [row["rejected_mask"] for row in rows]
        # The prompt ends where the completion's mask starts (at least one prompt token is kept for the prefix).
        starts = [max(1, mask.index(1)) for mask in masks]
        prompt_ids, prompt_mask = left_pad([ids[:start] for ids, start in zip(sequences, starts)], pad)
        completions = [ids[start:] for ids, start in zip(sequences, starts)]
        completion_mask = pad_right([[1] * len(completion) for completion in completions], 0)
        return {
            **join_sequences(prompt_ids, prompt_mask, pad_right(completions, pad), completion_mask),
            "margin": margin,
        }

    def loss_weight(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        pairs = batch["input_ids"].shape[0] // 2
        rewards = _rewards(policy, batch, self.tokens)
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


def _rewards(policy, batch: dict, tokens: TokenForward) -> torch.Tensor:
    """[2B] rewards of a collated batch. A split batch (`rm.share_prefix`) runs each distinct prompt once and
    the completions against its keys and values (rollout/prefix_scoring.py, prefix = the whole prompt), or, for a
    model that cannot share a cache, one plain forward of the left-padded rows with their positions. With
    sequence parallelism (`tokens` cuts sequences) every position's score is gathered and each row's last
    token read, by the rule of the plain forward."""
    if isinstance(tokens, SequenceShards):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        scores = tokens.per_position(lambda cut: policy(**cut, every_position=True), inputs)
        last = last_non_pad_positions(batch["input_ids"], getattr(policy, "module", policy).pad_token_id)
        return scores[torch.arange(scores.shape[0], device=scores.device), last]
    if "response_ids" not in batch:
        return policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    if shares_prompt(policy, {}):
        return policy(**shared_prompt_inputs(policy, batch, carry=0))
    return policy(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )
