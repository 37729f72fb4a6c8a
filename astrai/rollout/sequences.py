"""The one place where "sequence = prompt + response", its masks and its response log-probs are made.

Generation, `grpo` and `online_ppo` all use this layout (N sequences, P prompt columns, R response columns):

    prompt_ids, prompt_mask        [N, P]      LEFT-padded: every prompt ends at column P - 1, so
                                               generation appends to all rows at the same column
    response_ids, response_mask    [N, R]      RIGHT-padded; the mask keeps every token up to and
                                               including the first EOS (the EOS is trained: it is
                                               the policy's decision to stop)
    input_ids, attention_mask      [N, P + R]  prompt ++ response
    position_ids                   [N, P + R]  cumsum(attention_mask) - 1, 0 on left padding: the
                                               positions `generate` gives a left-padded batch; a plain
                                               forward would count the padding and disagree with it

Response token t sits at column P + t and is predicted by the logits at column P + t - 1, so the
response logits of a forward over the whole sequence are logits[:, P - 1 : P + R - 1].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.algos.ppo import entropy_from_logits
from astrai.models.output_head import chunked_token_statistics
from astrai.models.policy import forward_parameters
from astrai.rollout.packed import packed_response_forward, packed_response_values
from astrai.rollout.shared_prompt import cache_consumed, shared_prompt_forward, shared_prompt_inputs, shares_prompt


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both [N, longest], padding on the left. Masks are int64 0/1."""
    longest = max(len(sequence) for sequence in sequences)
    ids = [[pad_token_id] * (longest - len(sequence)) + list(sequence) for sequence in sequences]
    mask = [[0] * (longest - len(sequence)) + [1] * len(sequence) for sequence in sequences]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def _is_eos(token_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    eos = torch.tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids), device=token_ids.device
    )
    return torch.isin(token_ids, eos)


def response_mask(response_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """[N, R] int64: 1 on every token up to and including the row's first EOS, 0 after it.

    A row without EOS (cut at max_new_tokens) keeps all R tokens. Whatever follows the first EOS
    (`generate` pads finished rows with the pad token, which may be the EOS itself) is masked.
    """
    is_eos = _is_eos(response_ids, eos_token_ids).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def truncated_rows(response_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """[N] bool: the row has no EOS, i.e. generation stopped at max_new_tokens."""
    return ~_is_eos(response_ids, eos_token_ids).any(dim=1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] positions counting only attended tokens (0 on left padding), as `generate` assigns them."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def join_sequences(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """prompt [N, P] ++ response [N, R] -> input_ids, attention_mask, position_ids [N, P + R],
    plus response_ids and response_mask [N, R] (what the losses read)."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def response_logits(
    model,
    sequences: dict[str, torch.Tensor],
    temperature: float = 1.0,
    vocab_size: int | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """`response_forward`'s logits [N, R, vocab]."""
    return response_forward(model, sequences, temperature, vocab_size, packed=packed)[0]


def response_forward(
    model,
    sequences: dict[str, torch.Tensor],
    temperature: float = 1.0,
    vocab_size: int | None = None,
    packed: bool = False,
    shared_prompt: bool = False,
    **options,
) -> tuple[torch.Tensor, object]:
    """Logits that predict each response token: [N, R, vocab], divided by `temperature`; with `vocab_size`
    (the tokenizer's length) only the first vocab_size ids, those the sampler may draw (a padded model
    vocabulary's extra rows are cut: `algos.logprobs.real_vocabulary`).

    `model` is anything called like a transformers causal LM (an engine, a frozen engine, a bare
    model); `sequences` holds input_ids, attention_mask, position_ids [N, P + R] and response_ids
    [N, R]. Dividing by the sampling temperature makes these the log-probs of the distribution the
    tokens were sampled from (as TRL and verl do), so ratios and KL compare like with like.
    Returns (logits, the model's whole output); `options` go to the forward (e.g. output_router_logits).
    `packed` (rl.packing): the same logits from one forward without the padding (rollout/packed.py).
    `shared_prompt` (rl.share_prefix): the same logits, each distinct prompt run once (rollout/shared_prompt.py).
    """
    response_len = sequences["response_ids"].shape[1]
    prompt_len = sequences["input_ids"].shape[1] - response_len
    inputs = scoring_inputs(model, sequences)
    if packed:
        logits, output = packed_response_forward(model, sequences, _keeps_logits(model), **options)
    elif shared_prompt and shares_prompt(model, options):
        logits, output = shared_prompt_forward(model, sequences)
    elif _keeps_logits(model):  # the LM head over the last R + 1 columns only, not over the whole prompt
        output = model(**inputs, **options, logits_to_keep=response_len + 1)
        logits = output.logits[:, :response_len]
    else:
        output = model(**inputs, **options)
        logits = output.logits[:, prompt_len - 1 : prompt_len - 1 + response_len]
    return sampled_distribution(logits, temperature, vocab_size), output


def sampled_distribution(logits: torch.Tensor, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """Logits of the distribution the sampler drew from: the first vocab_size ids, divided by the temperature."""
    logits = real_vocabulary(logits, vocab_size)
    return logits if temperature == 1.0 else logits / temperature


def response_token_statistics(
    model,
    sequences: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = 0,
    entropy: str | None = None,
    packed: bool = False,
    shared_prompt: bool = False,
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None, object]:
    """(log-probs [N, R] float32, 0 where response_mask is 0; entropy [N, R] or None; the model's output) of the
    responses, as `response_forward` + `masked_token_logprobs` + `entropy_from_logits` give them. With
    `chunk_size` (`train.logits_chunk_size`) the full [N, R, vocab] logits are never made
    (models/output_head.py); entropy: None, "metric" (no gradient) or "trained". `packed`, `shared_prompt`: see
    `response_forward`."""
    response_ids, mask = sequences["response_ids"], sequences["response_mask"]
    response_len = response_ids.shape[1]
    prompt_len = sequences["input_ids"].shape[1] - response_len
    scored = response_ids.masked_fill(~mask.bool(), -100)
    shared_prompt = shared_prompt and not packed and shares_prompt(model, options)
    if shared_prompt:  # the prefix forward has run; the second forward's R positions predict the R tokens
        inputs, before, labels, extra = shared_prompt_inputs(model, sequences), 0, scored, {}
    else:
        inputs = scoring_inputs(model, sequences)
        # The output layer sees the last R + 1 positions (logits_to_keep) or all P + R; the response's
        # predictions are the R of them from column P - 1 on.
        kept = _keeps_logits(model)
        before = 0 if kept else prompt_len - 1
        labels = torch.nn.functional.pad(scored, (before, 1), value=-100)
        extra = {"logits_to_keep": response_len + 1} if kept else {}
    chunked = (
        None
        if packed  # rl.packing: the packed forward's own layout
        else chunked_token_statistics(
            model,
            inputs,
            labels,
            chunk_size=chunk_size,
            temperature=temperature,
            vocab_size=vocab_size,
            entropy=entropy,
            **extra,
            **options,
        )
    )
    if chunked is not None:
        columns = slice(before, before + response_len)
        entropies = None if chunked.entropy is None else chunked.entropy[:, columns]
        return chunked.logprobs[:, columns], entropies, chunked.output
    if shared_prompt:
        # A model found to change its logits after the output layer has run the chunked forward: prefix again.
        inputs = shared_prompt_inputs(model, sequences) if cache_consumed(inputs) else inputs
        output = model(**inputs)
        logits = sampled_distribution(output.logits, temperature, vocab_size)
    else:
        logits, output = response_forward(model, sequences, temperature, vocab_size, packed=packed, **options)
    logprobs = masked_token_logprobs(logits, response_ids, mask)
    if entropy == "trained":
        return logprobs, entropy_from_logits(logits), output
    if entropy == "metric":
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits.detach()), output
    return logprobs, None, output


def scoring_inputs(model, sequences: dict[str, torch.Tensor]) -> dict:
    """The forward inputs of a scoring (not generating) forward, with use_cache=False where the model takes it:
    such a forward has no later step to reuse a cache for, and with the model's default (use_cache true) every
    attention layer copies its keys and values into a new cache (~3% of the benchmark's GRPO step)."""
    inputs = {key: sequences[key] for key in ("input_ids", "attention_mask", "position_ids")}
    if _forward_takes(type(getattr(model, "module", model)), "use_cache"):
        inputs["use_cache"] = False
    return inputs


def _keeps_logits(model) -> bool:
    """Whether the causal LM under `model` (an engine wraps it as `.module`) takes transformers'
    `logits_to_keep`: most do; for one that does not, the full logits are sliced instead."""
    return _forward_takes(type(getattr(model, "module", model)), "logits_to_keep")


def _forward_takes(model_class: type, argument: str) -> bool:
    """Whether the class's forward names `argument` (read once per class)."""
    return argument in forward_parameters(model_class)


def response_values(
    critic, sequences: dict[str, torch.Tensor], packed: bool = False, shared_prompt: bool = False
) -> torch.Tensor:
    """The critic's value of each response token's state: [N, R] float32, 0 on padding.

    `critic` maps input_ids, attention_mask, position_ids [N, P + R] to values [N, P + R] (a
    `ValueModel` or its engine). Like the logits, V_t for response token t is read at column
    P + t - 1: the state in which token t is chosen (the prompt and response tokens before it).
    `packed` (rl.packing): the same values from one forward without the padding (rollout/packed.py).
    `shared_prompt` (rl.share_prefix): the same values, each distinct prompt run once (rollout/shared_prompt.py).
    """
    if packed:
        return packed_response_values(critic, sequences)
    if shared_prompt and shares_prompt(critic, {}):
        values = critic(**shared_prompt_inputs(critic, sequences))  # its R positions: the R states
    else:
        values = critic(
            input_ids=sequences["input_ids"],
            attention_mask=sequences["attention_mask"],
            position_ids=sequences["position_ids"],
        )
        response_len = sequences["response_ids"].shape[1]
        prompt_len = sequences["input_ids"].shape[1] - response_len
        values = values[:, prompt_len - 1 : prompt_len - 1 + response_len]
    return torch.where(sequences["response_mask"].bool(), values, torch.zeros_like(values))


def masked_token_logprobs(logits: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p(response token) [N, R] float32 from response logits [N, R, vocab]; 0 where mask is 0."""
    logprobs = token_logprobs(logits, response_ids)
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))


def forward_batches(total: int, batch_size: int, batches: list[list[int]] | None) -> list[list[int]]:
    """The sequence indices of each forward: `batches` when given (rl.packing's token cut, as many on every
    rank; an empty one is a forward whose output is dropped), else `batch_size` sequences at a time."""
    if batches is not None:
        return batches
    return [list(range(start, min(start + batch_size, total))) for start in range(0, total, batch_size)]


def _row_by_row(function, sequences: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
    """`function` ([n, ...] sequences -> [n, R] float32) over each batch of rows, put back at its rows' places."""
    total = sequences["input_ids"].shape[0]
    result = None
    for rows in batches:
        if not rows:  # ZeRO-3: every rank runs as many forwards (each gathers the weights); this one is dropped
            function({key: value[:1] for key, value in sequences.items()})
            continue
        contiguous = rows == list(range(rows[0], rows[-1] + 1))  # a view, no copy (the plain cut's batches)
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=sequences["input_ids"].device)
        part = function({key: value[index] for key, value in sequences.items()})
        if result is None:
            result = part.new_zeros((total, *part.shape[1:]))
        result[index] = part
    return result


@torch.no_grad()
def response_logprobs(
    model,
    sequences: dict[str, torch.Tensor],
    *,
    temperature: float,
    batch_size: int,
    vocab_size: int | None = None,
    chunk_size: int = 0,
    packed: bool = False,
    batches: list[list[int]] | None = None,
    shared_prompt: bool = False,
) -> torch.Tensor:
    """Per-token log-probs of the responses under `model`, no gradient: [N, R] float32, 0 on padding;
    normalised over the first `vocab_size` ids (see `response_logits`); chunked over positions with
    `chunk_size` (`train.logits_chunk_size`, see `response_token_statistics`).

    Evaluated `batch_size` sequences at a time (or in `batches`, see `forward_batches`) to bound activation
    memory. Under ZeRO-3 every rank must run as many forwards (each is a collective); the online strategies
    ensure it.
    """

    def logprobs(chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        return response_token_statistics(
            model,
            chunk,
            temperature=temperature,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            packed=packed,
            shared_prompt=shared_prompt,
        )[0]

    return _row_by_row(logprobs, sequences, forward_batches(sequences["input_ids"].shape[0], batch_size, batches))


@torch.no_grad()
def frozen_response_values(
    critic,
    sequences: dict[str, torch.Tensor],
    *,
    batch_size: int,
    packed: bool = False,
    batches: list[list[int]] | None = None,
    shared_prompt: bool = False,
) -> torch.Tensor:
    """`response_values` without gradient, `batch_size` sequences at a time (or in `batches`): [N, R] float32.
    Under ZeRO-3 every rank must run as many forwards, as `response_logprobs`."""
    total = sequences["input_ids"].shape[0]
    return _row_by_row(
        lambda chunk: response_values(critic, chunk, packed, shared_prompt),
        sequences,
        forward_batches(total, batch_size, batches),
    )
