"""Per-token and per-sequence log-probabilities from a causal language model's logits.

log p(y_t | y_<t) = logits_t[y_t] - logsumexp_v logits_t[v]

Memory: `log_softmax(logits)` would materialise a second [batch, seq_len, vocab] tensor (and a
float32 copy of a bfloat16 one is twice the size again). We subtract the logsumexp instead and
go a block of sequences at a time (`row_blocks`: as many as fit in BLOCK_ELEMENTS, at least one), so the
extra memory peaks at one [seq_len, vocab] float32 block or 16 MiB, whichever is larger. (Small blocks
go in one op: a row at a time cost a GRPO step of the small benchmark model ~10% in per-op overhead.)
That bound holds under `torch.no_grad()` (reference and rollout log-probs); with autograd on, each
row's float32 copy of half-precision logits is kept for the backward pass, as in any fp32 upcast.
Results are float32 whatever the logits' dtype: bfloat16 has ~3 significant digits, too few for
the log-ratios PPO and DPO take of these numbers.

Labels < 0 (the -100 "ignore index" of Hugging Face) are allowed and give 0; mask them out.

Padded vocabularies: a model's output layer often has more rows than its tokenizer has tokens (vocab
padded to a multiple of 64 or 128). Those ids decode to nothing, so they are never sampled and must not
take probability mass from the real ones either: `real_vocabulary` cuts the logits to the tokenizer's ids
before any softmax, and every log-prob then renormalises over the real vocabulary.
"""

import torch

from astrai.algos.masked import masked_sum

BLOCK_ELEMENTS = 2**22  # logits entries per block: 16 MiB in float32; one [seq_len, vocab] row of a real model is more


def row_blocks(tensor: torch.Tensor) -> int:
    """Rows of `tensor` ([batch, ...]) per block: as many as hold BLOCK_ELEMENTS entries, at least one."""
    row = max(1, tensor[0].numel()) if tensor.shape[0] else 1
    return max(1, BLOCK_ELEMENTS // row)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def real_vocabulary(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """logits[..., :vocab_size]: the scores of the ids the tokenizer has (a view, no copy).

    logits: [..., model_vocab]; vocab_size: the tokenizer's length, None (or >= model_vocab) for all.
    """
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    return logits[..., :vocab_size]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[b, t] | ...) read from logits[b, t]: logits[b, t, label] - logsumexp(logits[b, t]).

    logits: [batch, seq_len, vocab] (any float dtype); labels: [batch, seq_len] token ids,
    already aligned with the logits (see `shift_for_next_token`).
    Returns [batch, seq_len] in float32 (float64 for float64 logits); 0 where labels < 0.
    Differentiable with respect to the logits.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    ignored = labels < 0
    safe_labels = torch.where(ignored, torch.zeros_like(labels), labels)
    rows = []
    size = row_blocks(logits)
    for block_logits, block_labels in zip(logits.split(size), safe_labels.split(size)):  # [rows, seq_len, vocab]
        block_logits = block_logits.to(_compute_dtype(logits.dtype))
        chosen = torch.gather(block_logits, -1, block_labels.unsqueeze(-1)).squeeze(-1)
        rows.append(chosen - torch.logsumexp(block_logits, dim=-1))
    if rows:
        logps = rows[0] if len(rows) == 1 else torch.cat(rows)
    else:
        logps = torch.zeros(labels.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
    return torch.where(ignored, torch.zeros_like(logps), logps)


def sequence_logprobs(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p(sequence) = sum_t mask[b, t] * token_logps[b, t].

    token_logps, mask: [batch, seq_len]. Returns [batch]. Padding does not enter, whatever it holds.
    """
    return masked_sum(token_logps, mask, dim=-1)


def shift_for_next_token(
    logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align next-token predictions with their targets: logits at t predict the token at t + 1.

    logits: [batch, seq_len, vocab]; input_ids, mask: [batch, seq_len], where mask marks the
    tokens to score (e.g. the response tokens of a prompt + response sequence).
    Returns (logits[:, :-1], input_ids[:, 1:], mask[:, 1:]), each of length seq_len - 1;
    the first token is never scored (nothing predicts it). Views, no copies.
    """
    if logits.shape[:-1] != input_ids.shape or input_ids.shape != mask.shape:
        raise ValueError(
            f"shapes differ: logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)}, mask {tuple(mask.shape)}"
        )
    return logits[:, :-1], input_ids[:, 1:], mask[:, 1:]
