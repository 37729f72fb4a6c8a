"""Padding-free packing: the rows of a micro-batch concatenated into one row, positions restarting at every row.

transformers 5 reads a packed row from `position_ids` when a forward gets `attention_mask=None`
(`masking_utils.find_packed_sequence_indices`: a position that does not follow its predecessor by 1 starts
a new sequence). sdpa, eager and flex attention then get a causal mask that is also block-diagonal over the
rows (`packed_sequence_mask_function`); flash_attention_2/3 take their variable-length path with cu_seqlens
built from the same position_ids. So nothing here builds a 4D mask: a packed micro-batch is `input_ids` and
`position_ids` [1, T] with no attention mask and no cache (`use_cache=False`: with a cache, which a model
in eval mode makes by default, transformers skips the detection and rows attend to each other), and the
attention implementation keeps the rows apart (tests/unit/test_packing.py checks that a packed row's logits
equal the rows run one by one). Under sdpa that mask makes every row attend against every other's keys
(masked, but computed); a policy running sdpa is therefore switched to astrai/models/segment_attention.py,
which gets the rows' boundaries from `model_inputs` (cu_seq_lens_q, flash's varlen keyword) and runs causal
sdpa on each row alone.

Loss alignment never crosses a row: logits at t predict the token at t + 1, and the first token of every
row gets loss_mask 0 (nothing of its own row predicts it), so the last token of one row never scores the
first of the next. Padded rows never score their first token either, so both count the same loss tokens.
"""

from __future__ import annotations

import torch

from astrai.errors import AstraiError

# sdpa one packed row at a time (astrai/models/segment_attention.py): what a policy running sdpa switches to.
SEGMENT_ATTENTION = "astrai_segment_sdpa"
# Set on the position ids of a sequence-parallel cut (models/token_forward.py): the attention wrapper of
# engine/sequence_parallel.py runs Ulysses for that forward (and its recompute in backward) and no other.
SEQUENCE_SHARD_MARK = "_astrai_sequence_shard"
# Attention implementations of transformers that keep packed rows apart from position_ids alone.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", SEGMENT_ATTENTION)


class PackingError(AstraiError, ValueError):
    """Packing asked for with something that cannot keep packed rows apart, or a row over the token budget."""


def check_packing_attention(model, key: str) -> None:
    """Refuse packing (`key` names the setting) for an attention implementation that would let rows attend
    to each other; called on the built model, before the first step."""
    implementation = attention_of(model)
    if implementation not in PACKING_ATTENTION:
        raise PackingError(
            f"{key}: true needs an attention implementation that keeps packed rows apart "
            f"({', '.join(PACKING_ATTENTION)}); this model uses {implementation!r} "
            "(model.attn_implementation or ASTR_BACKEND), or set the packing key to false"
        )


def row_positions(lengths: list[int]) -> torch.Tensor:
    """[sum(lengths)] positions 0..n-1 of every row, one after the other."""
    return torch.cat([torch.arange(length) for length in lengths]) if lengths else torch.zeros(0, dtype=torch.long)


def pack_sequences(sequences: list[list[int]], masks: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows -> one packed row: input_ids, position_ids, loss_mask, attention_mask (all ones: the token count
    of the metrics, never handed to the model) [1, T], and sequence_lengths [rows]. The first token of every
    row gets loss_mask 0 (see the module docstring)."""
    lengths = [len(sequence) for sequence in sequences]
    loss_mask = []
    for mask in masks:
        loss_mask.extend([0, *mask[1:]] if mask else [])
    return {
        "input_ids": torch.tensor([[token for sequence in sequences for token in sequence]], dtype=torch.long),
        "position_ids": row_positions(lengths).unsqueeze(0),
        "loss_mask": torch.tensor([loss_mask], dtype=torch.long),
        "attention_mask": torch.ones(1, sum(lengths), dtype=torch.long),
        "sequence_lengths": torch.tensor(lengths, dtype=torch.long),
    }


def is_packed(batch: dict) -> bool:
    return "position_ids" in batch and "sequence_lengths" in batch


def model_inputs(batch: dict, model=None) -> dict[str, torch.Tensor | None]:
    """The forward's keywords: a packed batch (or `seq`'s document mask) goes as input_ids + position_ids with
    attention_mask None, the signal transformers reads packed rows from; a padded one as input_ids +
    attention_mask. A `model` switched to SEGMENT_ATTENTION also gets the rows' boundaries (cu_seq_lens_q/k,
    the keywords of transformers' flash varlen path)."""
    if "position_ids" not in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": None,
        "position_ids": batch["position_ids"],
        "use_cache": False,  # with a cache (the default of a model in eval mode) transformers never looks
    }
    if "sequence_lengths" in batch and attention_of(model) == SEGMENT_ATTENTION:
        inputs.update(segment_keywords(batch["sequence_lengths"].to(batch["input_ids"].device)))
    return inputs


def segment_keywords(lengths: torch.Tensor) -> dict:
    """cu_seq_lens_q/k [rows + 1] (int32) and max_length_q/k of a packed row of rows `lengths`."""
    edges = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
    edges[1:] = torch.cumsum(lengths, 0)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": edges, "cu_seq_lens_k": edges, "max_length_q": longest, "max_length_k": longest}


def attention_of(model) -> str | None:
    """The attention implementation of a transformers model, an engine around one, or None."""
    module = getattr(model, "module", model)
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def document_positions(input_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`seq`'s document mask inside blocks of EOS-separated documents: (position_ids, starts) [batch, len].

    Positions restart after every EOS (the token that ends a document), so attention stops at document
    boundaries; `starts` marks the first token of each document after the block's first (its loss is
    dropped: the EOS before it belongs to another document and must not predict it)."""
    is_eos = (input_ids == eos_token_id).long()
    document = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before: the document index in the block
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = document[:, 1:] != document[:, :-1]
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    first = torch.where(starts, index, torch.zeros_like(index))
    first = torch.cummax(first, dim=1).values  # each token's document start
    return index - first, starts


def segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of a packed row's values per row: values [T] (packed order), lengths [rows] with sum T -> [rows].
    Differentiable with respect to values."""
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths.to(values.device))
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, segments, values)
