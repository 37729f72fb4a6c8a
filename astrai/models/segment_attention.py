"""Causal attention of a packed row one row at a time: sdpa's variable-length path for the CPU.

transformers keeps packed rows apart under sdpa with a [T, T] block-diagonal mask (astrai/data/packing.py).
That is correct, but sdpa then computes every query against every key of the micro-batch (T^2 work for a row
of T tokens, whatever its rows) and, given a mask, cannot use its causal kernel. flash_attention_2's varlen
path computes each row alone (sum of L_i^2); it needs a GPU. This attention does the same with sdpa:
`segment_sdpa` splits the packed row at `cu_seq_lens_q` (the kwargs transformers' flash path reads, passed
by `data.packing.model_inputs` only to a model switched to it) and runs causal sdpa on each row. Any other
forward (padded batches, generation with a cache) has no cu_seq_lens and goes to transformers' sdpa with its
mask, unchanged. `use_segment_attention` switches a model that runs sdpa, when packing is on.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from astrai.data.packing import SEGMENT_ATTENTION, attention_of, check_packing_attention

logger = logging.getLogger("astrai.packing")


def segment_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, heads, T, dim], key/value [1, kv_heads, T, dim] of a packed row whose rows start at
    cu_seq_lens_q [rows + 1]; returns ([1, T, heads, dim], None) as transformers' attention functions do."""
    boundaries = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if boundaries is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    outputs = []
    edges = boundaries.tolist()
    for start, end in zip(edges[:-1], edges[1:]):
        output, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            dropout,
            scaling,
            is_causal=True,
            **kwargs,
        )
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENT_ATTENTION, sdpa_mask)  # what its padded forwards get, as sdpa


def use_segment_attention(model) -> bool:
    """Switch a transformers model (or an engine's module) that runs sdpa to `segment_sdpa`; True if switched."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(module, "set_attn_implementation"):
        return False
    module.set_attn_implementation(SEGMENT_ATTENTION)
    return True


def check_packing_job(job, model) -> None:
    """Before the first step: `check_packing_attention` for whichever of data.packing, data.document_mask,
    rl.packing the job sets; with packing a policy running sdpa switches to `segment_sdpa`."""
    for key, value in (
        ("data.packing", job.data.packing),
        ("data.document_mask", job.data.document_mask),
        ("rl.packing", job.rl.packing),
    ):
        if value:
            check_packing_attention(model, key)
    if job.data.packing or job.rl.packing:
        use_segment_attention(model)  # sdpa: each packed row alone, as flash_attention_2's varlen path
        budget = f"up to {job.train.micro_batch_tokens} tokens per micro-batch, " if job.data.packing else ""
        logger.info("packing: %sattention %s", budget, attention_of(model))
