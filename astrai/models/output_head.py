"""Token log-probs and entropy of a causal LM without its full [batch, seq_len, vocab] logits.

`train.logits_chunk_size`. How: for one forward, the model's output layer (`get_output_embeddings()`, a
plain nn.Linear) computes the statistics from the hidden states it is given, chunk by chunk
(`algos.chunked_logprobs`), and
returns them in place of the logits: [N, T, 1] log-probs, or [N, T, 2] with the entropy. Running inside
the output layer's own call keeps everything the model does around it: `logits_to_keep`, a
mixture-of-experts router loss, and under ZeRO-3 DeepSpeed's hooks on that module, which gather its
(possibly tied) weight once for the forward and once for the backward, not once per chunk.

Exactness: the statistics equal those of the full logits only if the model returns its output layer's
result unchanged. Models that transform the logits afterwards (Gemma 2 / Gemma 3's final logit
softcapping, Cohere's logit scale, Granite's logits scaling) would apply that to our statistics; we see
it, as `output.logits` is then not the tensor the layer returned, name the model type once in the log,
and the caller takes the full-logits path for that model from then on. A known softcapping is refused
before any forward, and an output layer that is not a plain nn.Linear (a LoRA adapter on it) too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from astrai.algos.chunked_logprobs import head_statistics

logger = logging.getLogger("astrai.models")

REFUSED = "_astrai_chunking_refused"  # set on an output layer whose model changes the logits after it


@dataclass
class TokenStatistics:
    """log-probs [N, T] (0 where the label is < 0), entropy [N, T] or None, and the model's output (whose
    `logits` hold the statistics, not the vocabulary's scores)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    output: object


def bare_model(model) -> torch.nn.Module:
    """The transformers model under an engine (`.module`) or a wrapper."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and model.module is not model:
        model = model.module
    return model


def chunking_refusal(model) -> str | None:
    """Why the chunked path cannot reproduce `model`'s logits exactly, or None when it can."""
    bare = bare_model(model)
    config = getattr(bare, "config", None)
    model_type = getattr(config, "model_type", type(bare).__name__)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "final_logit_softcapping", None):
        return f"{model_type} applies final logit softcapping after its output layer"
    head = bare.get_output_embeddings() if hasattr(bare, "get_output_embeddings") else None
    if head is None or type(head) is not torch.nn.Linear:
        return f"{model_type}'s output layer is {type(head).__name__}, not a plain torch.nn.Linear"
    if getattr(head, REFUSED, None):
        return getattr(head, REFUSED)
    return None


def chunked_token_statistics(
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
    """One forward of `model` on `inputs` (+ `options`, e.g. logits_to_keep) whose output layer returns the
    statistics of `labels` [N, T] (aligned with the positions the layer sees; < 0 = not scored, never
    computed). None, before any forward, when chunking is off (`chunk_size` 0), when the N x T positions fit
    in one chunk, or when the model's logits cannot be reproduced; None after a forward when the model turns
    out to change its logits after the layer (the caller then takes the full-logits path)."""
    if chunk_size <= 0 or labels.numel() <= chunk_size:
        return None
    refusal = chunking_refusal(model)
    if refusal is not None:
        _log_refusal_once(model, refusal)
        return None
    head = bare_model(model).get_output_embeddings()
    returned = {}

    def statistics_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"output layer input {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}")
        flat_labels = labels.reshape(-1)
        rows = (flat_labels >= 0).nonzero().squeeze(1)
        logps, entropies = head_statistics(
            hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),
            head.weight,
            head.bias,
            flat_labels.index_select(0, rows),
            chunk_size=chunk_size,
            temperature=temperature,
            vocab_size=vocab_size,
            entropy=entropy,
        )
        columns = [logps] if entropies is None else [logps, entropies]
        placed = [logps.new_zeros(flat_labels.shape[0]).index_copy(0, rows, column) for column in columns]
        returned["statistics"] = torch.stack(placed, dim=-1).view(*labels.shape, len(columns))
        return returned["statistics"]

    head.forward = statistics_forward  # an instance attribute: module hooks (ZeRO-3's) still run around it
    try:
        output = model(**inputs, **options)
    finally:
        del head.forward
    statistics = returned.get("statistics")
    if statistics is None or output.logits is not statistics:
        model_type = getattr(bare_model(model).config, "model_type", type(bare_model(model)).__name__)
        setattr(head, REFUSED, f"{model_type} changes its logits after its output layer")
        _log_refusal_once(model, getattr(head, REFUSED))
        return None
    return TokenStatistics(statistics[..., 0], statistics[..., 1] if entropy else None, output)


def _log_refusal_once(model, reason: str) -> None:
    bare = bare_model(model)
    if getattr(bare, "_astrai_refusal_logged", False):
        return
    bare._astrai_refusal_logged = True  # a plain attribute: once per model, not per micro-batch
    logger.warning("train.logits_chunk_size: %s; log-probs from the full logits for this model", reason)


def next_token_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] labels for a forward over all T positions: position t scores input_ids[t + 1] where
    loss_mask[t + 1] is 1; -100 elsewhere and at the last position (nothing follows it)."""
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(~loss_mask[:, 1:].bool(), -100)
    return labels
