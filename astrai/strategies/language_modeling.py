"""`seq` (pre-training on packed text) and `sft` (chat fine-tuning, prompt tokens masked).

Both minimise next-token cross-entropy over the tokens their loss mask keeps; they differ only in
how rows become tokens.
"""

from __future__ import annotations

import math
from functools import partial

import datasets

from astrai.algos.cross_entropy import next_token_cross_entropy_sum
from astrai.data import render_rows, tokenize_rows
from astrai.data.collate import collate_token_rows
from astrai.data.packing import document_positions, model_inputs, pack_sequences
from astrai.data.render import is_text_row, pack_batch, sft_batch
from astrai.data.sources import Rows
from astrai.models.output_head import next_token_labels
from astrai.strategies.base import StepOutput, Strategy, register
from astrai.train_types import SeqRules, SftRules


class LanguageModelingStrategy(Strategy):
    loop = "offline"
    eval_metric_names = ("loss", "perplexity")

    def collate(self, rows: list[dict]) -> dict:
        """Right-padded [rows, longest], or with `data.packing` one packed row [1, tokens] (data/packing.py)."""
        if self.job.data.packing:
            return pack_sequences([row["input_ids"] for row in rows], [row["loss_mask"] for row in rows])
        return collate_token_rows(rows, self.tokenizer.pad_token_id)

    def loss_weight(self, batch: dict) -> int:
        """Loss tokens of the micro-batch (the unit the step's loss is averaged over)."""
        return int(batch["loss_mask"][:, 1:].sum())

    def compute_loss(self, policy, batch: dict, normalizer: float) -> StepOutput:
        """Loss = sum of token losses / (global loss tokens of the step / (ranks x accumulation)).

        DeepSpeed then divides by the accumulation steps and averages over ranks, so the update is
        exactly the token-mean over the whole optimizer step. A mixture-of-experts policy adds its router's
        load-balancing term (`router_aux_loss`); the logged `loss` is the cross-entropy alone.
        """
        options = self.router_options(policy)  # a mixture of experts returns its load-balancing loss
        inputs = model_inputs(batch, policy)
        labels = next_token_labels(batch["input_ids"], batch["loss_mask"])
        chunk_size = self.job.train.logits_chunk_size
        chunked = self.tokens.statistics(policy, inputs, labels, chunk_size=chunk_size, **options)
        if chunked is None:  # the full [batch, seq_len, vocab] logits (models/output_head.py says when)
            output = policy(**inputs, **options)
            loss_sum, count = next_token_cross_entropy_sum(output.logits, batch["input_ids"], batch["loss_mask"])
        else:
            output, loss_sum, count = chunked.output, -chunked.logprobs.sum(), (labels >= 0).sum()
        sums = {"loss": float(loss_sum.detach()), "weight": float(count)}
        router = self.router_aux_loss(policy, output, float(count), normalizer, sums, float(count))
        loss = loss_sum / normalizer + router
        return StepOutput(loss, sums)

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """`loss`: the token mean of the cross-entropy over every held-out loss token of every rank;
        `perplexity`: exp(loss)."""
        loss = totals["loss"] / max(totals["weight"], 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}  # exp(>709) overflows a float


@register
class SeqStrategy(LanguageModelingStrategy):
    """Pre-training: text packed into blocks of `data.max_seq_len` tokens, every token trained."""

    name = "seq"
    rules = SeqRules
    renders_chats = False

    def prepare_data(self, rows: Rows) -> tuple[datasets.Dataset, int]:
        field, skipped = self.job.data.text_field, 0
        if self.job.data.on_bad_row == "skip":
            before = len(rows.dataset)
            rows.dataset = rows.dataset.filter(lambda row: is_text_row(row, field))
            skipped = before - len(rows.dataset)
        function = partial(pack_batch, tokenizer=self.tokenizer, field=field, block_len=self.job.data.max_seq_len)
        return tokenize_rows(rows, function, num_proc=self.job.data.num_proc, description="packing"), skipped

    def collate(self, rows: list[dict]) -> dict:
        """Blocks [rows, max_seq_len]; with `data.document_mask` positions restart after every EOS, attention
        stays inside each document and a document's first token is not predicted by the one before it."""
        batch = collate_token_rows(rows, self.tokenizer.pad_token_id)
        if self.job.data.document_mask:
            batch["position_ids"], starts = document_positions(batch["input_ids"], self.tokenizer.eos_token_id)
            batch["loss_mask"] = batch["loss_mask"].masked_fill(starts, 0)
        return batch


@register
class SftStrategy(LanguageModelingStrategy):
    """Supervised fine-tuning on chats; only assistant tokens are trained."""

    name = "sft"
    rules = SftRules

    def prepare_data(self, rows: Rows) -> tuple[datasets.Dataset, int]:
        return render_rows(rows, sft_batch, tokenizer=self.tokenizer, data=self.job.data, description="rendering chats")
