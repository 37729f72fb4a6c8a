"""Token log-probs and entropy straight from the final hidden states, a chunk of positions at a time.

    logits_i = hidden_i W^T + b      log p_i = logits_i[y_i] - logsumexp(logits_i)
    H_i = logsumexp(logits_i) - sum_v softmax(logits_i)_v logits_i,v

Memory: the output layer of a 151,936-token vocabulary turns a micro-batch of 4 x 1024 positions into a
[4, 1024, 151936] tensor: 2.5 GB in fp32, and softmax temporaries and its gradient double or triple it.
Here only `chunk_size` positions have logits at a time. With autograd on, each chunk runs under
non-reentrant activation checkpointing (torch.utils.checkpoint): nothing of a chunk's logits is kept
for the backward pass, which recomputes that chunk's logits (one more matmul of the output layer per
chunk; Liger's fused linear cross-entropy avoids that by taking the gradient in the forward, which
needs the loss to be a plain sum of token terms, not a PPO ratio or an entropy bonus). A single chunk
is computed directly: no recomputation when everything fits in one.

The numbers are those of `logprobs.token_logprobs` and `ppo.entropy_from_logits` applied to the full
logits (the same functions run on each chunk; log-probs alone through cross_entropy, the same
log-softmax fused), up to the floating-point order of the output matmul.
The gradient of the weight is one sum over chunks, so a hook on it (DeepSpeed's gradient reduction)
fires once per backward, as with the full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.algos.ppo import entropy_from_logits

ENTROPY_MODES = (None, "metric", "trained")


def head_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    entropy: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` (and the entropy) under logits = hidden @ weight.T + bias, in chunks of positions.

    hidden: [M, D] (any float dtype); weight: [V, D]; bias: [V] or None; labels: [M] token ids >= 0.
    The logits are cut to the first `vocab_size` ids (`logprobs.real_vocabulary`), then divided by
    `temperature`, in the hidden states' dtype, as `rollout.scoring`'s forwards do.
    entropy: None (not computed), "metric" (no gradient) or "trained" (differentiable).
    Returns (log-probs [M], entropy [M] or None), float32 (float64 for float64 hidden states).
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape or hidden.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [M, D] with labels [M], got {tuple(labels.shape)}")
    if (labels < 0).any():
        raise ValueError("labels must be token ids >= 0: select the scored positions first")

    compute_dtype = hidden.dtype if hidden.dtype in (torch.float32, torch.float64) else torch.float32

    def chunk_statistics(chunk_hidden, chunk_weight, chunk_bias, chunk_labels):
        logits = real_vocabulary(F.linear(chunk_hidden, chunk_weight, chunk_bias), vocab_size).unsqueeze(0)
        if temperature != 1.0:
            logits = logits / temperature
        if entropy is None:  # log_softmax + gather, fused: its backward keeps one [chunk, vocab] block, not three
            return (-F.cross_entropy(logits[0].to(compute_dtype), chunk_labels, reduction="none"),)
        logps = token_logprobs(logits, chunk_labels.unsqueeze(0))[0]
        if entropy == "metric":
            with torch.no_grad():
                return logps, entropy_from_logits(logits.detach())[0]
        return logps, entropy_from_logits(logits)[0]

    needs_graph = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    starts = range(0, labels.shape[0], chunk_size)
    parts = []
    for start in starts:
        arguments = (hidden[start : start + chunk_size], weight, bias, labels[start : start + chunk_size])
        if needs_graph and len(starts) > 1:
            parts.append(checkpoint(chunk_statistics, *arguments, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(chunk_statistics(*arguments))
    if not parts:
        empty = hidden.new_zeros(0, dtype=compute_dtype)
        return empty, (empty if entropy else None)
    logps = torch.cat([part[0] for part in parts])
    return logps, (torch.cat([part[1] for part in parts]) if entropy else None)
