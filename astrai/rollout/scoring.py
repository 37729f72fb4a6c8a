"""The scoring forward: the log-probs, entropies and critic values of responses, one object chosen once per job.

Every online caller (the behaviour log-probs of `generate_rollout`, the reference and critic targets, the
policy and critic losses) asks a `ScoringForward` built by `scoring_forward(job)`; the job's choice of forward
lives in which variant that is, never in keywords threaded through the calls:

    PlainForward          one forward over prompt ++ response [N, P + R] (the LM head over the last R + 1
                          columns where the model takes `logits_to_keep`)
    PackedForward         rl.packing: one packed row of the attended tokens only (rollout/packed_scoring.py)
    SharedPrefixForward   rl.share_prefix: each distinct prompt run once, the responses against its keys and
                          values (rollout/prefix_scoring.py); a model it cannot serve takes the plain forward
    SequenceParallelForward  parallel.sequence_parallel_size > 1: the sequences packed into one row of their
                          attended tokens, cut along its length over the sequence-parallel group (Ulysses,
                          models/token_forward.py); each rank gets every sequence's statistics and values

All give the same numbers up to float rounding. The object also holds what the job fixes for every scoring:
the sampling temperature and the tokenizer's vocabulary (the distribution the tokens were drawn from),
`train.logits_chunk_size` (the output layer's statistics chunk by chunk, models/output_head.py), and the
micro-batches of the no-gradient forwards (`frozen_logprobs`, `frozen_values`).

Layout (rollout/sequences.py): response token t sits at column P + t and is predicted by the output at column
P + t - 1, so the response's logits and values are those of columns P - 1 .. P + R - 2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.algos.ppo import entropy_from_logits
from astrai.models.output_head import chunked_token_statistics
from astrai.models.policy import forward_parameters
from astrai.models.token_forward import PLAIN_TOKENS, SequenceShards, TokenForward
from astrai.rollout.packed_scoring import packed_response_forward, packed_response_values
from astrai.rollout.prefix_scoring import cache_consumed, shared_prompt_forward, shared_prompt_inputs, shares_prompt

Sequences = dict[str, torch.Tensor]
# The sequence indices of each no-gradient forward over a rank's sequences (see `forward_batches`).
MicroBatches = Callable[[Sequences], list[list[int]]]


class ScoringForward:
    """What every scoring caller asks: `logits`, `token_statistics` (log-probs, entropy), `values` of one
    micro-batch, with gradient where enabled; `frozen_logprobs`, `frozen_values` of all of a rank's sequences,
    without gradient, micro-batch by micro-batch.

    `sequences` holds input_ids, attention_mask, position_ids [N, P + R] and response_ids, response_mask [N, R]
    (`join_sequences`). `model` is anything called like a transformers causal LM (an engine, a frozen engine, a
    bare or peft model); `critic` maps those inputs to values [N, P + R] (a `ValueModel` or its engine).

    temperature: the sampling temperature; the logits are divided by it, so log-probs are those of the
    distribution the tokens were sampled from (as TRL and verl do) and ratios and KL compare like with like.
    vocab_size: the tokenizer's length; only the first vocab_size ids, those the sampler may draw, are kept
    (`algos.logprobs.real_vocabulary`). chunk_size: `train.logits_chunk_size`. micro_batches: the cut of the
    no-gradient forwards; None runs all the sequences in one forward.
    """

    name = "plain"

    def __init__(
        self,
        temperature: float = 1.0,
        vocab_size: int | None = None,
        chunk_size: int = 0,
        micro_batches: MicroBatches | None = None,
    ):
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size
        self.micro_batches = micro_batches

    def logits(self, model, sequences: Sequences, **options) -> tuple[torch.Tensor, object]:
        """(logits predicting each response token [N, R, vocab] of the sampled distribution, the model's whole
        output); `options` go to the forward (e.g. output_router_logits)."""
        raise NotImplementedError

    def token_statistics(
        self, model, sequences: Sequences, entropy: str | None = None, **options
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """(log-probs [N, R] float32, 0 where response_mask is 0; entropy [N, R] or None; the model's output) of
        the responses. entropy: None, "metric" (no gradient) or "trained". With `chunk_size` the full
        [N, R, vocab] logits are never made where the variant allows it."""
        logits, output = self.logits(model, sequences, **options)
        return statistics_of_logits(logits, sequences, entropy, output)

    def values(self, critic, sequences: Sequences) -> torch.Tensor:
        """The critic's value of each response token's state: [N, R] float32, 0 on padding. V_t for response
        token t is read where the token is predicted: the state in which it is chosen."""
        raise NotImplementedError

    @torch.no_grad()
    def frozen_logprobs(self, model, sequences: Sequences) -> torch.Tensor:
        """`token_statistics`' log-probs of every sequence, no gradient, one micro-batch at a time: [N, R] float32.
        Under ZeRO-3 every rank must run as many forwards (each is a collective); the micro-batches ensure it."""
        return self._row_by_row(lambda part: self.token_statistics(model, part)[0], sequences)

    @torch.no_grad()
    def frozen_values(self, critic, sequences: Sequences) -> torch.Tensor:
        """`values` of every sequence, no gradient, one micro-batch at a time: [N, R] float32."""
        return self._row_by_row(lambda part: self.values(critic, part), sequences)

    def _row_by_row(self, function, sequences: Sequences) -> torch.Tensor:
        """`function` ([n, ...] sequences -> [n, R] float32) over each micro-batch, put back at its rows' places."""
        total = sequences["input_ids"].shape[0]
        batches = [list(range(total))] if self.micro_batches is None else self.micro_batches(sequences)
        result = None
        for rows in batches:
            if not rows:  # ZeRO-3: every rank runs as many forwards (each gathers the weights); this one is dropped
                function({key: value[:1] for key, value in sequences.items()})
                continue
            contiguous = rows == list(range(rows[0], rows[-1] + 1))  # a view, no copy (the plain cut's batches)
            device = sequences["input_ids"].device
            index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
            part = function({key: value[index] for key, value in sequences.items()})
            if result is None:
                result = part.new_zeros((total, *part.shape[1:]))
            result[index] = part
        return result

    def _sampled(self, logits: torch.Tensor) -> torch.Tensor:
        return sampled_distribution(logits, self.temperature, self.vocab_size)

    def _chunked(self, model, inputs: dict, labels: torch.Tensor, entropy: str | None, **options):
        """`chunked_token_statistics` with this job's settings (None: take the full logits)."""
        return chunked_token_statistics(model, inputs, labels, **self._statistics_settings(entropy), **options)

    def _statistics_settings(self, entropy: str | None) -> dict:
        """What the job fixes for every token-statistics forward: chunk size, temperature, vocabulary."""
        return {
            "chunk_size": self.chunk_size,
            "temperature": self.temperature,
            "vocab_size": self.vocab_size,
            "entropy": entropy,
        }


class PlainForward(ScoringForward):
    """One forward over prompt ++ response; the output layer sees the last R + 1 positions (logits_to_keep) or,
    for a model without that option, all P + R, and the R from column P - 1 on are the response's."""

    name = "plain"

    def logits(self, model, sequences: Sequences, **options) -> tuple[torch.Tensor, object]:
        response_len = sequences["response_ids"].shape[1]
        prompt_len = sequences["input_ids"].shape[1] - response_len
        inputs = scoring_inputs(model, sequences)
        if keeps_logits(model):  # the LM head over the last R + 1 columns only, not over the whole prompt
            output = model(**inputs, **options, logits_to_keep=response_len + 1)
            logits = output.logits[:, :response_len]
        else:
            output = model(**inputs, **options)
            logits = output.logits[:, prompt_len - 1 : prompt_len - 1 + response_len]
        return self._sampled(logits), output

    def token_statistics(
        self, model, sequences: Sequences, entropy: str | None = None, **options
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        response_len = sequences["response_ids"].shape[1]
        prompt_len = sequences["input_ids"].shape[1] - response_len
        kept = keeps_logits(model)
        before = 0 if kept else prompt_len - 1
        labels = torch.nn.functional.pad(scored_labels(sequences), (before, 1), value=-100)
        extra = {"logits_to_keep": response_len + 1} if kept else {}
        chunked = self._chunked(model, scoring_inputs(model, sequences), labels, entropy, **extra, **options)
        if chunked is not None:
            return statistics_of_chunks(chunked, slice(before, before + response_len))
        logits, output = PlainForward.logits(self, model, sequences, **options)  # this forward, in every subclass
        return statistics_of_logits(logits, sequences, entropy, output)

    def values(self, critic, sequences: Sequences) -> torch.Tensor:
        values = critic(
            input_ids=sequences["input_ids"],
            attention_mask=sequences["attention_mask"],
            position_ids=sequences["position_ids"],
        )
        response_len = sequences["response_ids"].shape[1]
        prompt_len = sequences["input_ids"].shape[1] - response_len
        return masked_values(values[:, prompt_len - 1 : prompt_len - 1 + response_len], sequences)


class PackedForward(ScoringForward):
    """rl.packing: one forward without the padding, its outputs put back at [N, R] (rollout/packed_scoring.py). The
    chunked output layer is not used here: the packed forward keeps only the scored positions already."""

    name = "packed"

    def logits(self, model, sequences: Sequences, **options) -> tuple[torch.Tensor, object]:
        logits, output = packed_response_forward(model, sequences, keeps_logits(model), **options)
        return self._sampled(logits), output

    def values(self, critic, sequences: Sequences) -> torch.Tensor:
        return packed_response_values(critic, sequences)


class SharedPrefixForward(PlainForward):
    """rl.share_prefix: a prefix forward of the distinct prompts, then the responses against their keys and
    values (rollout/prefix_scoring.py). A model `shares_prompt` refuses (sliding windows, forward options,
    gradient checkpointing in training) takes the plain forward; every rank decides alike."""

    name = "shared_prefix"

    def logits(self, model, sequences: Sequences, **options) -> tuple[torch.Tensor, object]:
        if not shares_prompt(model, options):
            return super().logits(model, sequences, **options)
        logits, output = shared_prompt_forward(model, sequences)
        return self._sampled(logits), output

    def token_statistics(
        self, model, sequences: Sequences, entropy: str | None = None, **options
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        if not shares_prompt(model, options):
            return super().token_statistics(model, sequences, entropy, **options)
        # The prefix forward has run; the second forward's R positions predict the R tokens.
        inputs = shared_prompt_inputs(model, sequences)
        chunked = self._chunked(model, inputs, scored_labels(sequences), entropy)
        if chunked is not None:
            return statistics_of_chunks(chunked, slice(0, sequences["response_ids"].shape[1]))
        # A model found to change its logits after the output layer has run the chunked forward: prefix again.
        inputs = shared_prompt_inputs(model, sequences) if cache_consumed(inputs) else inputs
        output = model(**inputs)
        return statistics_of_logits(self._sampled(output.logits), sequences, entropy, output)

    def values(self, critic, sequences: Sequences) -> torch.Tensor:
        if not shares_prompt(critic, {}):
            return super().values(critic, sequences)
        return masked_values(critic(**shared_prompt_inputs(critic, sequences)), sequences)  # R positions: R states


class SequenceParallelForward(ScoringForward):
    """parallel.sequence_parallel_size > 1: every forward through the job's sequence shards (`SequenceShards`),
    which pack the attended tokens of the sequences into one row and cut it over the group; the statistics
    and values of the whole row come back to every rank. Response token t (column P + t) is scored at column
    P + t - 1, as in the plain forward's full-width layout."""

    name = "sequence_parallel"

    def __init__(self, shards: SequenceShards, *arguments):
        super().__init__(*arguments)
        self.shards = shards

    def logits(self, model, sequences: Sequences, **options) -> tuple[torch.Tensor, object]:
        raise NotImplementedError("sequence-parallel scoring gives statistics and values, never the full logits")

    def token_statistics(
        self, model, sequences: Sequences, entropy: str | None = None, **options
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        response_len = sequences["response_ids"].shape[1]
        before = sequences["input_ids"].shape[1] - response_len - 1
        labels = torch.nn.functional.pad(scored_labels(sequences), (before, 1), value=-100)
        inputs = {key: sequences[key] for key in ("input_ids", "attention_mask", "position_ids")}
        statistics = self.shards.statistics(model, inputs, labels, **self._statistics_settings(entropy), **options)
        return statistics_of_chunks(statistics, slice(before, before + response_len))

    def values(self, critic, sequences: Sequences) -> torch.Tensor:
        inputs = {key: sequences[key] for key in ("input_ids", "attention_mask", "position_ids")}
        values = self.shards.per_position(lambda cut: critic(**cut), inputs)
        response_len = sequences["response_ids"].shape[1]
        before = sequences["input_ids"].shape[1] - response_len - 1
        return masked_values(values[:, before : before + response_len], sequences)


def scoring_forward(
    job, vocab_size: int | None = None, micro_batches: MicroBatches | None = None, tokens: TokenForward = PLAIN_TOKENS
) -> ScoringForward:
    """The job's scoring forward: sequence-parallel when `tokens` (the strategy's token forward) cuts sequences
    over a group, packed with rl.packing, shared-prefix with rl.share_prefix (the schema refuses any two), else
    plain; at rollout.temperature and train.logits_chunk_size. vocab_size: the tokenizer's length; micro_batches:
    the no-gradient forwards' cut (the strategy's `forward_batches`)."""
    settings = (job.rollout.temperature, vocab_size, job.train.logits_chunk_size, micro_batches)
    if isinstance(tokens, SequenceShards):
        return SequenceParallelForward(tokens, *settings)
    variant = PackedForward if job.rl.packing else SharedPrefixForward if job.rl.share_prefix else PlainForward
    return variant(*settings)


def sampled_distribution(logits: torch.Tensor, temperature: float, vocab_size: int | None) -> torch.Tensor:
    """Logits of the distribution the sampler drew from: the first vocab_size ids, divided by the temperature."""
    logits = real_vocabulary(logits, vocab_size)
    return logits if temperature == 1.0 else logits / temperature


def masked_token_logprobs(logits: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p(response token) [N, R] float32 from response logits [N, R, vocab]; 0 where mask is 0."""
    logprobs = token_logprobs(logits, response_ids)
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))


def statistics_of_logits(logits: torch.Tensor, sequences: Sequences, entropy: str | None, output):
    """(log-probs [N, R], entropy [N, R] or None, output) from response logits [N, R, vocab]."""
    logprobs = masked_token_logprobs(logits, sequences["response_ids"], sequences["response_mask"])
    if entropy == "trained":
        return logprobs, entropy_from_logits(logits), output
    if entropy == "metric":
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits.detach()), output
    return logprobs, None, output


def statistics_of_chunks(chunked, columns: slice):
    """(log-probs, entropy or None, output) of the response's columns of a chunked output layer's statistics."""
    entropies = None if chunked.entropy is None else chunked.entropy[:, columns]
    return chunked.logprobs[:, columns], entropies, chunked.output


def scored_labels(sequences: Sequences) -> torch.Tensor:
    """The response ids [N, R] with -100 where response_mask is 0 (not scored, never computed)."""
    return sequences["response_ids"].masked_fill(~sequences["response_mask"].bool(), -100)


def masked_values(values: torch.Tensor, sequences: Sequences) -> torch.Tensor:
    """The response's values [N, R] with 0 where response_mask is 0."""
    return torch.where(sequences["response_mask"].bool(), values, torch.zeros_like(values))


def scoring_inputs(model, sequences: Sequences) -> dict:
    """The forward inputs of a scoring (not generating) forward, with use_cache=False where the model takes it:
    such a forward has no later step to reuse a cache for, and with the model's default (use_cache true) every
    attention layer copies its keys and values into a new cache (~3% of the benchmark's GRPO step)."""
    inputs = {key: sequences[key] for key in ("input_ids", "attention_mask", "position_ids")}
    if _forward_takes(type(getattr(model, "module", model)), "use_cache"):
        inputs["use_cache"] = False
    return inputs


def keeps_logits(model) -> bool:
    """Whether the causal LM under `model` (an engine wraps it as `.module`) takes transformers'
    `logits_to_keep`: most do; for one that does not, the full logits are sliced instead."""
    return _forward_takes(type(getattr(model, "module", model)), "logits_to_keep")


def _forward_takes(model_class: type, argument: str) -> bool:
    """Whether the class's forward names `argument` (read once per class)."""
    return argument in forward_parameters(model_class)


def forward_batches(total: int, batch_size: int) -> list[list[int]]:
    """The sequence indices of `total` sequences cut `batch_size` at a time."""
    return [list(range(start, min(start + batch_size, total))) for start in range(0, total, batch_size)]


def batches_of(batch_size: int) -> MicroBatches:
    """A `micro_batches` cut of `batch_size` sequences at a time (train.micro_batch_size without rl.packing)."""
    return lambda sequences: forward_batches(sequences["input_ids"].shape[0], batch_size)
