"""`rl.packing`: the forwards of grpo and online_ppo (policy, reference, critic) without their padding.

A micro-batch of prompt + response sequences [N, P + R] (left-padded prompts, right-padded responses) runs
as one packed row [1, T] of its attended tokens only, positions restarting at every sequence (the
positions `generate` gave them), attention_mask None and no cache: transformers keeps the rows apart
(astrai/data/packing.py). Only the logits that predict a response token are computed (`logits_to_keep`
as the packed indices), and they are put back at their [N, R] places, zeros elsewhere (masked by every
loss), so the losses, their normalisers and everything after the forward are unchanged.
"""

from __future__ import annotations

import torch

from astrai.data.packing import SEGMENT_ATTENTION, PackingError, attention_of, segment_keywords


def pack_padded(sequences: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Padded sequences -> (packed forward inputs [1, T], keep [K], scored [N, R] bool).

    keep: the packed index of the token whose output predicts each scored response token (row-major order,
    increasing); scored: response_mask as bool, the [N, R] places those K outputs go back to. The response
    mask is a prefix of each response (tokens up to the first EOS), so every predicting token is attended.
    """
    attention = sequences["attention_mask"].bool()
    positions = sequences.get("position_ids")
    if positions is None:
        positions = (sequences["attention_mask"].long().cumsum(dim=1) - 1).clamp(min=0)
    inputs = {
        "input_ids": sequences["input_ids"][attention].unsqueeze(0),
        "attention_mask": None,
        "position_ids": positions[attention].unsqueeze(0),
    }
    packed_index = (attention.flatten().long().cumsum(0) - 1).view(attention.shape)
    response_len = sequences["response_ids"].shape[1]
    prompt_len = sequences["input_ids"].shape[1] - response_len
    scored = sequences["response_mask"].bool()
    keep = packed_index[:, prompt_len - 1 : prompt_len - 1 + response_len][scored]
    return inputs, keep, scored


def unpack(outputs: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """[K, ...] outputs of the scored places -> [N, R, ...], zeros elsewhere (differentiable)."""
    unpacked = outputs.new_zeros((*scored.shape, *outputs.shape[1:]))
    unpacked[scored] = outputs
    return unpacked


def packed_response_forward(model, sequences: dict[str, torch.Tensor], keeps_logits: bool, **options):
    """(response logits [N, R, vocab] before temperature and vocabulary cut, the model's output)."""
    inputs, keep, scored = pack_padded(sequences)
    if attention_of(model) == SEGMENT_ATTENTION:  # a policy switched to sdpa one row at a time
        inputs.update(segment_keywords(sequences["attention_mask"].sum(dim=1)))
    if keeps_logits:
        output = model(**inputs, use_cache=False, **options, logits_to_keep=keep)
        logits = output.logits[0]
    else:
        output = model(**inputs, use_cache=False, **options)
        logits = output.logits[0, keep]
    return unpack(logits, scored), output


def packed_response_values(critic, sequences: dict[str, torch.Tensor]) -> torch.Tensor:
    """The critic's values of the response tokens' states [N, R] float32, 0 on padding (see scoring.py's `values`)."""
    inputs, keep, scored = pack_padded(sequences)
    if attention_of(critic) == SEGMENT_ATTENTION:  # a critic whose trunk runs sdpa one row at a time
        inputs.update(segment_keywords(sequences["attention_mask"].sum(dim=1)))
    values = critic(**inputs)  # a ValueModel runs its trunk without a cache
    return unpack(values[0, keep], scored)


def token_micro_batches(tokens: list[int], budget: int) -> list[list[int]]:
    """`rl.packing`'s cut of sequences into forward micro-batches of at most `budget` tokens each (prompt +
    response tokens, `train.micro_batch_tokens`), every sequence whole: first-fit over the sequences from the
    longest, so a step runs few micro-batches. Returns each micro-batch's sequence indices, ascending; a
    sequence over the budget is refused."""
    for index, length in enumerate(tokens):
        if length > budget:
            raise PackingError(
                f"rollout sequence {index} has {length} prompt + response tokens, more than train.micro_batch_tokens "
                f"{budget}: raise train.micro_batch_tokens (a sequence is never split) to at least data.max_seq_len "
                "+ rollout.max_new_tokens"
            )
    batches: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        place = next((b for b, load in enumerate(loads) if load + tokens[index] <= budget), len(batches))
        if place == len(batches):
            batches.append([])
            loads.append(0)
        batches[place].append(index)
        loads[place] += tokens[index]
    return [sorted(batch) for batch in batches]
