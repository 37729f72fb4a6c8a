"""`dpo`: preference optimisation against a frozen reference model.

Each micro-batch holds B pairs; chosen and rejected run as one forward of 2B sequences. The loss is
the mean over the optimizer step's pairs (the loop divides by the global pair count). The reference
is either held as a frozen engine (partitioned under ZeRO-3) or, with `dpo.precompute_reference`,
evaluated once over the whole data set before training and then freed: it never changes, so one
pass serves every epoch.

The reference-free losses (`dpo.loss: simpo | orpo`) score each completion by its average token
log-prob under the policy alone: no reference model is built, so `dpo.precompute_reference` and
`model.reference_path` are refused with them.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import datasets
import torch

from astrai.algos.dpo import dpo_loss
from astrai.algos.logprobs import real_vocabulary, sequence_logprobs, shift_for_next_token, token_logprobs
from astrai.algos.preference import REFERENCE_FREE_LOSSES, orpo_loss, simpo_loss
from astrai.config import ConfigError
from astrai.data import render_rows
from astrai.data.collate import pad_right
from astrai.data.packing import is_packed, model_inputs, pack_sequences, segment_sums
from astrai.data.render import preference_batch
from astrai.engine import all_gather_objects
from astrai.models.output_head import next_token_labels
from astrai.models.token_forward import PLAIN_TOKENS, TokenForward
from astrai.strategies.base import StepOutput, Strategy, register
from astrai.strategies.frozen_reference import build_reference
from astrai.train_types import DpoRules

if TYPE_CHECKING:  # Run holds the strategy: named for annotations only, the strategies never import training/
    from astrai.training.run_parts import Run

logger = logging.getLogger("astrai.dpo")
REFERENCE_COLUMNS = ("reference_chosen_logps", "reference_rejected_logps")
AVERAGED_LOSSES = ("ipo", *REFERENCE_FREE_LOSSES)  # these papers score completions by their mean token log-prob


def completion_logprobs(
    model,
    batch: dict,
    average: bool = False,
    vocab_size: int | None = None,
    chunk_size: int = 0,
    tokens: TokenForward = PLAIN_TOKENS,
) -> torch.Tensor:
    """Log-probs of each sequence's completion tokens, summed (or averaged, as IPO scores
    completions): [2B] for a batch of 2B sequences. vocab_size: the tokenizer's length, over whose ids
    they normalise (a padded model vocabulary's extra rows take no probability; None: all ids).
    chunk_size: `train.logits_chunk_size` (models/output_head.py; 0: the full logits). tokens: the job's token
    forward (`Strategy.tokens`: plain, or sequence-parallel cuts)."""
    return completion_forward(model, batch, average, vocab_size, chunk_size, tokens)[0]


def completion_forward(
    model,
    batch: dict,
    average: bool = False,
    vocab_size: int | None = None,
    chunk_size: int = 0,
    tokens: TokenForward = PLAIN_TOKENS,
    **options,
):
    """`completion_logprobs` [2B] and the model's whole output (e.g. a router's `aux_loss`); `options` go to
    the forward."""
    inputs = model_inputs(batch, model)
    chunked = None
    # A packed row is scored the full way (its sums are per segment), except in sequence-parallel cuts.
    if not is_packed(batch) or tokens.sequence_parallel_size > 1:
        labels = next_token_labels(batch["input_ids"], batch["loss_mask"])
        chunked = tokens.statistics(model, inputs, labels, chunk_size=chunk_size, vocab_size=vocab_size, **options)
    if chunked is not None and is_packed(batch):  # position t scores token t + 1, of t's own sequence (or none)
        scored = (labels >= 0)[0].to(chunked.logprobs.dtype)
        logps = segment_sums(chunked.logprobs[0], batch["sequence_lengths"])
        counts = segment_sums(scored, batch["sequence_lengths"])
        return (logps / counts.clamp(min=1) if average else logps), chunked.output
    if chunked is not None:  # 0 on every unscored position: the plain sum is the masked one
        output, logps, counts = chunked.output, chunked.logprobs.sum(dim=-1), batch["loss_mask"][:, 1:].sum(dim=-1)
        return (logps / counts.clamp(min=1) if average else logps), output
    output = model(**inputs, **options)
    logits = real_vocabulary(output.logits, vocab_size)
    shifted_logits, labels, mask = shift_for_next_token(logits, batch["input_ids"], batch["loss_mask"])
    token_logps = token_logprobs(shifted_logits, labels)
    if is_packed(batch):  # one row [1, T]: each sequence's sum over its own tokens (data/packing.py)
        lengths = batch["sequence_lengths"].clone()
        lengths[0] -= 1  # the shift drops the packed row's first token, which is the first sequence's
        logps = segment_sums((token_logps * mask)[0], lengths)
        counts = segment_sums(mask[0].to(logps.dtype), lengths)
    else:
        logps, counts = sequence_logprobs(token_logps, mask), mask.sum(dim=-1)
    return (logps / counts.clamp(min=1) if average else logps), output


def _sequences(batch: dict) -> int:
    """Sequences of a micro-batch (2 per pair), padded [2B, T] or packed [1, T]."""
    return len(batch["sequence_lengths"]) if is_packed(batch) else batch["input_ids"].shape[0]


@register
class DpoStrategy(Strategy):
    name = "dpo"
    rules = DpoRules
    loop = "offline"
    sequences_per_row = 2  # chosen and rejected
    eval_metric_names = ("loss", "accuracy", "margin")

    def prepare_data(self, rows) -> tuple[datasets.Dataset, int]:
        return render_rows(
            rows,
            preference_batch,
            tokenizer=self.tokenizer,
            data=self.job.data,
            description="rendering preference pairs",
        )

    @classmethod
    def check_job(cls, job, world_size: int) -> None:
        settings = job.dpo
        if settings.label_smoothing and settings.loss != "sigmoid":
            raise ConfigError(
                f"`dpo.label_smoothing` applies to `dpo.loss: sigmoid` only, not {settings.loss!r}: set it to 0"
            )
        if settings.loss not in REFERENCE_FREE_LOSSES:
            return
        if settings.precompute_reference:
            raise ConfigError(
                f"`dpo.loss: {settings.loss}` uses no reference model: `dpo.precompute_reference` must be false"
            )
        if job.model.reference_path is not None:
            raise ConfigError(f"`dpo.loss: {settings.loss}` uses no reference model: remove `model.reference_path`")

    @classmethod
    def needs_reference(cls, job) -> bool:
        return job.dpo.loss not in REFERENCE_FREE_LOSSES

    @classmethod
    def keeps_reference(cls, job) -> bool:
        return cls.needs_reference(job) and not job.dpo.precompute_reference  # setup frees it once precomputed

    def setup(self, run: Run) -> None:
        self.device = run.dist.device
        if not self.needs_reference(self.job):
            self.reference, self.reference_source = None, None  # never built: the loss needs only the policy
            return
        policy_config = run.engines["policy"].ds_config
        self.reference, self.reference_source = build_reference(
            self.job, self.tokenizer, policy_config, policy=run.engines["policy"]
        )
        if self.job.dpo.precompute_reference:
            run.dataset = self._precompute(run, run.dataset)
            if run.eval_dataset is not None:  # the eval pairs need theirs too
                run.eval_dataset = self._precompute(run, run.eval_dataset)
            self.reference = None  # freed: the log-probs now travel with the data

    def _precompute(self, run: Run, dataset: datasets.Dataset) -> datasets.Dataset:
        """Reference log-probs of every pair, computed once, rank r taking pairs r, r+W, ...

        Every rank runs the same number of forwards (the last batch is padded with repeats) because
        a ZeRO-3 forward is a collective."""
        # The ranks of a sequence-parallel group share their pairs (each forward is the group's).
        size, world, micro = len(dataset), run.dist.data_parallel_size, self.job.train.micro_batch_size
        own = list(range(run.dist.data_parallel_rank, size, world))
        rounds = math.ceil(math.ceil(size / world) / micro)
        results: dict[int, tuple[float, float]] = {}
        for round_index in range(rounds):
            indices = (
                own[round_index * micro : (round_index + 1) * micro] or own[:1] or [0]
            )  # a rank without pairs pads
            batch = self._to_device(self.collate([dataset[i] for i in indices]))
            average = self.job.dpo.loss in AVERAGED_LOSSES
            logps = completion_logprobs(
                self.reference, batch, average, len(self.tokenizer), self.job.train.logits_chunk_size, self.tokens
            )
            pairs = len(indices)
            for position, index in enumerate(indices):
                results[index] = (float(logps[position]), float(logps[pairs + position]))
        merged: dict[int, tuple[float, float]] = {}
        for part in all_gather_objects(results):
            merged.update(part)
        logger.info("precomputed reference log-probs of %d pairs; the reference model is freed", len(merged))
        for column, position in zip(REFERENCE_COLUMNS, (0, 1)):
            dataset = dataset.add_column(column, [merged[i][position] for i in range(size)])
        return dataset

    def _to_device(self, batch: dict) -> dict:
        return {key: value.to(self.device) for key, value in batch.items()}

    def checkpoint_meta(self) -> dict:
        return {"reference": self.reference_source}

    def collate(self, rows: list[dict]) -> dict:
        """[2B, T]: the B chosen sequences, then the B rejected ones; with `data.packing` the same 2B sequences
        as one packed row [1, tokens] (a pair always stays in one micro-batch)."""
        sequences = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
        masks = [row["chosen_mask"] for row in rows] + [row["rejected_mask"] for row in rows]
        if self.job.data.packing:
            batch = pack_sequences(sequences, masks)
        else:
            batch = {
                "input_ids": pad_right(sequences, self.tokenizer.pad_token_id),
                "attention_mask": pad_right([[1] * len(sequence) for sequence in sequences], 0),
                "loss_mask": pad_right(masks, 0),
            }
        if REFERENCE_COLUMNS[0] in rows[0]:
            batch["reference_logps"] = torch.tensor(
                [row[REFERENCE_COLUMNS[0]] for row in rows] + [row[REFERENCE_COLUMNS[1]] for row in rows]
            )
        return batch

    def loss_weight(self, batch: dict) -> int:
        return _sequences(batch) // 2

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        pairs = _sequences(batch) // 2
        settings = self.job.dpo
        average = settings.loss in AVERAGED_LOSSES
        chunk_size, options = self.job.train.logits_chunk_size, self.router_options(policy)
        logps, output = completion_forward(
            policy, batch, average, len(self.tokenizer), chunk_size, self.tokens, **options
        )
        objective = self._objective(logps[:pairs], logps[pairs:], batch, average)
        chosen, rejected = logps[:pairs].detach(), logps[pairs:].detach()
        sums = {
            "loss": float(objective.losses.detach().sum()),
            "rewards_chosen": float(objective.rewards_chosen.sum()),
            "rewards_rejected": float(objective.rewards_rejected.sum()),
            "reward_margin": float((objective.rewards_chosen - objective.rewards_rejected).sum()),
            "reward_accuracy": float((objective.rewards_chosen > objective.rewards_rejected).sum()),
            "logps_chosen": float(chosen.sum()),
            "logps_rejected": float(rejected.sum()),
            "weight": float(pairs),
        }
        if settings.loss == "orpo":  # TRL's ORPOTrainer names: the NLL part, logsigmoid(log odds), the log odds
            sums["nll_loss"] = float(objective.nll_losses.sum())
            sums["log_odds_ratio"] = float(objective.log_odds_ratios.sum())
            sums["log_odds_chosen"] = float(objective.log_odds.sum())
        router = self.router_aux_loss(policy, output, float(pairs), normalizer, sums, float(pairs))
        loss = objective.losses.sum() / normalizer + router
        return StepOutput(loss, sums)

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Means over every held-out pair: the loss, the reward accuracy (chosen's implicit reward above the
        rejected's) and the reward margin (chosen minus rejected)."""
        pairs = max(totals["weight"], 1.0)
        return {
            "loss": totals["loss"] / pairs,
            "accuracy": totals["reward_accuracy"] / pairs,
            "margin": totals["reward_margin"] / pairs,
        }

    def _objective(self, chosen: torch.Tensor, rejected: torch.Tensor, batch: dict, average: bool):
        """The configured loss of B pairs from the policy's log-probs [B] each (averaged for ipo/simpo/orpo)."""
        settings = self.job.dpo
        if settings.loss == "simpo":
            return simpo_loss(chosen, rejected, beta=settings.beta, gamma=settings.simpo_gamma)
        if settings.loss == "orpo":
            return orpo_loss(chosen, rejected, beta=settings.beta)
        reference = batch.get("reference_logps")
        if reference is None:
            reference = completion_logprobs(
                self.reference, batch, average, len(self.tokenizer), self.job.train.logits_chunk_size, self.tokens
            )
        pairs = chosen.shape[0]
        return dpo_loss(
            chosen,
            rejected,
            reference[:pairs],
            reference[pairs:],
            beta=settings.beta,
            loss_type=settings.loss,
            label_smoothing=settings.label_smoothing,
        )
