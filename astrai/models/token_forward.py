"""The token statistics of a forward (log-probs of given labels, entropy), one object chosen once per job.

The offline train types ask `TokenForward.statistics(model, inputs, labels)` for the log-probs of `labels`
[N, T] (aligned with the positions: < 0 = not scored) under `model` on `inputs` (input_ids plus an attention
mask, or position ids for packed rows). Two variants:

    TokenForward        the model's own forward, the output layer chunked (`train.logits_chunk_size`,
                        models/output_head.py); None where chunking does not apply, and the caller then
                        reads the full logits as before
    SequenceShards      `parallel.sequence_parallel_size` > 1 (Ulysses): the micro-batch packed into one row of
                        its attended tokens, cut along its length over the sequence-parallel group; each rank
                        runs the model on its cut (attention exchanges heads, engine/sequence_parallel.py),
                        computes the statistics of its own positions, and the group gathers them, so every
                        rank returns the whole [N, T] and computes the loss of the whole micro-batch

Why each rank computes the whole loss: the loss math (per-token means, DPO's per-sequence sums, anything a
train type needs) stays the train type's own, unchanged. The gather's backward hands each rank only the
gradient of its own positions, so the parameters' gradients summed over the group (DeepSpeed sums over the
sequence ranks and averages over the data-parallel ones) are exactly those of the whole sequence, and the
metrics each rank sums are the whole micro-batch's: the loops divide the world's sums by the group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.data.packing import SEQUENCE_SHARD_MARK
from astrai.models.output_head import TokenStatistics, chunked_token_statistics
from astrai.models.policy import forward_parameters

# Keywords of a packed forward that describe the whole row; a cut of it has its own (none: Ulysses reads the
# documents from the gathered position ids).
WHOLE_ROW_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "logits_to_keep")


class TokenForward:
    """The plain forward: `chunked_token_statistics` with the job's chunk size (None: take the full logits)."""

    sequence_parallel_size = 1

    def statistics(
        self,
        model,
        inputs: dict,
        labels: torch.Tensor,
        *,
        chunk_size: int,
        temperature: float = 1.0,
        vocab_size: int | None = None,
        entropy: str | None = None,
        **options,
    ) -> TokenStatistics | None:
        return chunked_token_statistics(
            model,
            inputs,
            labels,
            chunk_size=chunk_size,
            temperature=temperature,
            vocab_size=vocab_size,
            entropy=entropy,
            **options,
        )


PLAIN_TOKENS = TokenForward()


class SequenceShards(TokenForward):
    """Ulysses: every micro-batch as one packed row, this rank's cut of it through the model, the statistics
    gathered over the group (module docstring). `group`: the sequence-parallel process group; `size`, `rank`:
    its size and this rank's place in it."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.sequence_parallel_size, self.rank = group, size, rank

    def statistics(
        self,
        model,
        inputs: dict,
        labels: torch.Tensor,
        *,
        chunk_size: int,
        temperature: float = 1.0,
        vocab_size: int | None = None,
        entropy: str | None = None,
        **options,
    ) -> TokenStatistics:
        row = packed_row(inputs, labels, self.sequence_parallel_size)
        local, cut = self._cut(row), self._slice(row)
        if "use_cache" in forward_parameters(type(getattr(model, "module", model))):
            local["use_cache"] = False
        local_labels = row.labels[cut].unsqueeze(0)
        options = {key: value for key, value in options.items() if key not in WHOLE_ROW_KEYWORDS}
        chunked = chunked_token_statistics(
            model,
            local,
            local_labels,
            chunk_size=chunk_size,
            temperature=temperature,
            vocab_size=vocab_size,
            entropy=entropy,
            **options,
        )
        if chunked is None:  # the cut's full logits: [1, T / sp, vocab], never the whole row's
            chunked = full_logits_statistics(model, local, local_labels, temperature, vocab_size, entropy, **options)
        logprobs = row.unpack(self._gather(chunked.logprobs[0]))
        entropies = None if chunked.entropy is None else row.unpack(self._gather(chunked.entropy[0]))
        return TokenStatistics(logprobs, entropies, chunked.output)

    def per_position(self, function, inputs: dict) -> torch.Tensor:
        """`function` (cut inputs: input_ids, position_ids, attention_mask None -> [1, T / sp] per position, e.g. a
        critic's values) over this rank's cut of `inputs`' packed row, gathered and put back at [N, T]."""
        row = packed_row(inputs, inputs["input_ids"], self.sequence_parallel_size)
        return row.unpack(self._gather(function(self._cut(row))[0]))

    def _slice(self, row: PackedRow) -> slice:
        return slice(self.rank * row.cut_length, (self.rank + 1) * row.cut_length)

    def _cut(self, row: PackedRow) -> dict:
        """This rank's cut of the row as forward inputs, its position ids marked for Ulysses."""
        cut = self._slice(row)
        positions = row.position_ids[cut].unsqueeze(0).contiguous()
        setattr(positions, SEQUENCE_SHARD_MARK, True)  # engine/sequence_parallel.py: run Ulysses for this forward
        return {"input_ids": row.input_ids[cut].unsqueeze(0), "position_ids": positions, "attention_mask": None}

    def _gather(self, cut: torch.Tensor) -> torch.Tensor:
        return GatheredCut.apply(cut, self.group, self.sequence_parallel_size, self.rank)


def full_logits_statistics(model, inputs, labels, temperature, vocab_size, entropy, **options) -> TokenStatistics:
    """The statistics of `labels` from the model's full logits (a model the chunked output layer refuses)."""
    from astrai.algos.ppo import entropy_from_logits

    output = model(**inputs, **options)
    logits = real_vocabulary(output.logits, vocab_size)
    logits = logits if temperature == 1.0 else logits / temperature
    logprobs = token_logprobs(logits, labels)
    entropies = None
    if entropy == "trained":
        entropies = entropy_from_logits(logits)
    elif entropy == "metric":
        with torch.no_grad():
            entropies = entropy_from_logits(logits.detach())
    return TokenStatistics(logprobs, entropies, output)


class PackedRow:
    """A micro-batch [N, T] as one row of its attended tokens, padded to a multiple of the group size: input ids,
    position ids (each sequence from 0; the padding a document of its own) and labels; `unpack` puts a
    statistic of the row back at [N, T] (0 on the padding)."""

    def __init__(self, input_ids, position_ids, labels, kept: torch.Tensor, shape: torch.Size, size: int):
        self.input_ids, self.position_ids, self.labels = input_ids, position_ids, labels
        self.kept, self.shape = kept, shape
        self.tokens = int(kept.sum())
        self.cut_length = input_ids.shape[0] // size

    def unpack(self, row: torch.Tensor) -> torch.Tensor:
        placed = row.new_zeros(self.kept.shape[0])
        placed = placed.masked_scatter(self.kept, row[: self.tokens])
        return placed.view(self.shape)


def packed_row(inputs: dict, labels: torch.Tensor, size: int) -> PackedRow:
    """`PackedRow` of a padded batch (attention_mask; the position ids given, else counted from each row's first
    attended token) or of packed rows (position_ids, no mask: every token is attended)."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    kept = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    positions = inputs.get("position_ids")
    if positions is None:
        positions = (kept.long().cumsum(dim=1) - 1).clamp(min=0)
    positions = positions.expand_as(input_ids)
    flat = kept.reshape(-1)
    ids, places, scored = (tensor.reshape(-1)[flat] for tensor in (input_ids, positions, labels))
    padding = -ids.shape[0] % size
    if padding:
        device = ids.device
        ids = torch.cat([ids, ids.new_zeros(padding)])
        places = torch.cat([places, torch.arange(padding, device=device, dtype=places.dtype)])
        scored = torch.cat([scored, scored.new_full((padding,), -100)])
    return PackedRow(ids, places, scored, flat, input_ids.shape, size)


class GatheredCut(torch.autograd.Function):
    """The group's cuts [T / sp] -> the whole row [T], in rank order. Every rank computes the same loss of the
    whole row, so the gradient of its cut is its own slice of the row's gradient (not a sum over ranks)."""

    @staticmethod
    def forward(ctx, cut: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        parts = [torch.empty_like(cut) for _ in range(size)]
        dist.all_gather(parts, cut.contiguous(), group=group)
        ctx.start, ctx.length = rank * cut.shape[0], cut.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        return gradient[ctx.start : ctx.start + ctx.length].contiguous(), None, None, None


def token_forward(dist) -> TokenForward:
    """The job's token forward for this rank's `DistInfo` (engine/distributed.py): sequence shards when its
    sequence-parallel group has more than one rank, else the plain forward."""
    if dist.sequence_parallel_size == 1:
        return TokenForward()
    return SequenceShards(dist.sequence_group, dist.sequence_parallel_size, dist.sequence_parallel_rank)
