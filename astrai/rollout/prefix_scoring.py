"""`rl.share_prefix`: the scoring forwards (policy, reference, behaviour, critic) run each distinct prompt once.

A grpo step scores group_size responses to every prompt, and a plain forward over prompt ++ response (TRL's,
verl's) runs every copy of the prompt: on short answers to long prompts most of the forward, and of the
policy's backward, is the same prompt again. Here a micro-batch's forward is two forwards of the same model
(the idea of Prefix Grouper, Liu et al. 2025):

1. the prefix: the distinct prompts' columns 0 .. P - 2 (all but the last prompt token), once each, with a
   cache: their keys and values at every layer;
2. the rest: every sequence's columns P - 1 .. P + R - 2 (the last prompt token, then the response but its
   last token) against its prompt's keys and values, picked out of (1) by row (`batch_select_indices`).

Its logits are exactly the R that predict the response tokens, as the plain forward (scoring.py) cuts them from
a full forward. Nothing is detached: the prefix's keys and values are ordinary tensors of the graph, so the backward
sums each prompt's gradient over its responses, as the full forward's backward does over its copies. The
values equal the full forward's up to float rounding (different GEMM shapes; tests/unit/rollout/
test_prefix_scoring.py: log-probs and gradients within 1e-5 in fp32).

The critic (online_ppo's ValueModel) runs the same two forwards; the R values of (2) are those of the
states in which the R response tokens are chosen, as the plain forward's `values` cuts them from a full forward.

With `train.logits_chunk_size` the second forward's output layer computes the statistics chunk by chunk as
always (models/output_head.py): it sees R positions a row, not P + R.

When it applies: a model whose forward takes a transformers 5 `cache` and whose cache is all `DynamicLayer`s
(no sliding windows, no recurrent state), no extra forward options (a mixture of experts' router logits would
miss the prefix's tokens), and not under gradient checkpointing (checkpointed layers drop the cache; the job
check refuses that combination). Otherwise the plain forward runs. Every rank decides alike (the model's class
and config), so ZeRO-3's forwards stay matched: two per micro-batch on every rank.
"""

from __future__ import annotations

import torch

from astrai.models.policy import causal_lm, forward_parameters


def shares_prompt(model, options: dict) -> bool:
    """Whether `shared_prompt_inputs` may serve `model` (an engine, a frozen engine, a peft or bare causal LM, or
    the critic's ValueModel)."""
    if options:
        return False
    base = causal_lm(model)
    if base.training and torch.is_grad_enabled() and getattr(base, "is_activation_checkpointing", False):
        return False
    return "cache" in forward_parameters(type(base)) and _plain_dynamic_cache(base.config)


def shared_prompt_forward(model, sequences: dict[str, torch.Tensor]) -> tuple[torch.Tensor, object]:
    """(logits [N, R, vocab] predicting each response token, the second forward's output) of prompt ++
    response sequences (`join_sequences`' layout: input_ids, attention_mask, position_ids [N, P + R],
    response_ids [N, R]), each distinct prompt run once (see the module's docstring)."""
    output = model(**shared_prompt_inputs(model, sequences))
    return output.logits, output


def shared_prompt_inputs(model, sequences: dict[str, torch.Tensor], carry: int = 1) -> dict:
    """Runs the prefix forward (1.) and returns the inputs of the second (2.), whose R outputs predict the R
    response tokens: input_ids, attention_mask, position_ids and the prefix's `cache`, picked out by row. The
    cache is the model's: a forward on these inputs extends it, so they serve one forward.

    carry: the prompt columns the second forward runs again. 1 (the default) for outputs that predict the
    response tokens (logits, the critic's values); 0 for outputs at the response's own positions (a reward
    model reads its last token, `RewardModel`): the prefix is then the whole prompt and the second forward's
    R outputs are those of the R response columns."""
    from transformers import DynamicCache

    input_ids, attention_mask = sequences["input_ids"], sequences["attention_mask"]
    positions = sequences["position_ids"]
    response_len = sequences["response_ids"].shape[1]
    if input_ids.shape[1] - response_len < carry + 1:  # a one-column prefix: a masked column keeps it non-empty
        input_ids, attention_mask, positions = (
            torch.nn.functional.pad(tensor, (1, 0), value=0) for tensor in (input_ids, attention_mask, positions)
        )
    prefix_len = input_ids.shape[1] - response_len - carry
    # Rows with the same prefix ids and mask have the same positions too (they follow from the mask).
    prefix = torch.cat([input_ids[:, :prefix_len], attention_mask[:, :prefix_len]], dim=1)
    distinct, row_prompt = torch.unique(prefix, dim=0, return_inverse=True)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    first_row = torch.full((distinct.shape[0],), input_ids.shape[0], device=input_ids.device)
    first_row = first_row.scatter_reduce(0, row_prompt, rows, "amin")
    base = causal_lm(model)
    accepted = forward_parameters(type(base))
    caching = {"use_cache": True} if "use_cache" in accepted else {}  # a critic caches whenever given a cache
    cache = DynamicCache(config=base.config)
    model(
        input_ids=distinct[:, :prefix_len],
        attention_mask=distinct[:, prefix_len:],
        position_ids=positions[first_row, :prefix_len],
        cache=cache,
        **caching,
        # no LM head over the prompt: its logits predict nothing that is scored
        **({"logits_to_keep": 1} if "logits_to_keep" in accepted else {}),
    )
    cache.batch_select_indices(row_prompt)  # differentiable indexing: the backward adds the rows of a prompt
    rest = slice(prefix_len, prefix_len + response_len)
    return {
        "input_ids": input_ids[:, rest],
        "attention_mask": attention_mask[:, : rest.stop],
        "position_ids": positions[:, rest],
        "cache": cache,
        **caching,
    }


def cache_consumed(inputs: dict) -> bool:
    """Whether a forward already ran on `shared_prompt_inputs`' inputs (their cache holds more than the prefix)."""
    return inputs["cache"].get_seq_length() != inputs["attention_mask"].shape[1] - inputs["input_ids"].shape[1]


def _plain_dynamic_cache(config) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=config).layers
    except (TypeError, ValueError, KeyError):  # a layer type DynamicCache cannot build
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
