"""The rollout's token sampler: draws each next token inside transformers' `generate` and, when asked,
keeps the sampled token's log-prob (the `sampler` source of behaviour log-probs).

Why not generate's own sampling: it draws with `torch.multinomial`, which on a CPU generates an
exponential variate for every vocabulary entry of every row (an exponential race): 1.3-1.4 ms for
8 rows x 8192 tokens, 12-14% of a decoding step of the 8.4M-parameter benchmark model
(benchmarks/rollout_speed.py). Inverse-CDF sampling needs one uniform per row: the cumulative sum
of the probabilities (float64, so that no token's interval is lost to rounding in a large
vocabulary) and a binary search, about 0.18 ms for the same rows. It is exact sampling from the
same distribution, which transformers' own warpers still shape (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, in generate's order). generate runs in greedy mode with this
processor last: it returns -inf for every token but the one drawn, so generate's argmax takes it and
its stopping, padding and KV cache work as they always do.

Padded vocabularies: with `vocab_size` (the tokenizer's length) the ids past it, rows of a padded output
layer that the tokenizer cannot decode, are cut off before the warpers: never drawn, and the kept
log-probs renormalise over the real vocabulary, as the losses' do (`algos.logprobs.real_vocabulary`).

Behaviour log-probs (`keep_logprobs`): the drawn token's log-prob under the model's raw logits, full
softmax at the sampling temperature (what the loss's forward computes), not under the top_k/top_p-
truncated distribution it was drawn from; kept for the step it is drawn at, so nothing [N, vocab]
outlives the step.
"""

from __future__ import annotations

import torch

from astrai.algos.logprobs import real_vocabulary

# Rows are drawn in chunks of at most this many vocabulary entries: the float64 probabilities and their
# cumulative sum are two [rows, vocab] tensors, 1.2 GB for 512 rollouts x a 150k vocabulary at once.
CHUNK_ELEMENTS = 1 << 22  # 32 MiB per float64 tensor


def inverse_cdf_sample(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [N] drawn from `probabilities` [N, V] (rows summing to 1, float64) with `uniforms` [N] in
    [0, 1): the first token whose cumulative probability exceeds u x the row's total. Tokens of
    probability 0 own an empty interval and are never drawn; u < 1 keeps the draw at or before the
    last token of positive probability."""
    cumulative = probabilities.cumsum(dim=-1)
    targets = uniforms.to(cumulative.dtype)[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets, right=True).squeeze(-1)


class TokenSampler:
    """A logits processor that samples the next token (see the module docstring); generate must run
    greedily (`do_sample=False`) with no processor after this one.

    temperature, top_k (0: off), top_p (1: off): the sampling knobs, as `rollout:` sets them.
    keep_logprobs: record each drawn token's log-prob (`logprobs()` returns them once generate is done).
    vocab_size: the tokenizer's length; ids from it on are never drawn (None: every id of the model).
    """

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        *,
        keep_logprobs: bool,
        chunk_elements: int = CHUNK_ELEMENTS,
        vocab_size: int | None = None,
    ):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.temperature = temperature
        self.keep_logprobs = keep_logprobs
        self.chunk_elements = chunk_elements
        self.vocab_size = vocab_size
        self.steps: list[torch.Tensor] = []  # [N] log-prob of the token drawn at each step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = real_vocabulary(scores, self.vocab_size).float()  # [N, vocab_size]: drawn ids index `scores` too
        warped = self.warpers(input_ids, logits)
        uniforms = torch.rand(logits.shape[0], device=logits.device)  # float32: < 1 - 2^-24, so u x total < total
        rows = max(1, self.chunk_elements // logits.shape[-1])
        tokens = torch.cat(
            [
                inverse_cdf_sample(
                    torch.softmax(warped[start : start + rows].double(), dim=-1), uniforms[start : start + rows]
                )
                for start in range(0, logits.shape[0], rows)
            ]
        )
        if self.keep_logprobs:
            scaled = logits / self.temperature
            drawn = scaled.gather(-1, tokens[:, None]).squeeze(-1)
            self.steps.append(drawn - torch.logsumexp(scaled, dim=-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens[:, None], 0.0)

    def logprobs(self, response_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N, R] float32 log-probs of response_ids, 0 where mask is 0 (pads after EOS)."""
        if not self.keep_logprobs:
            raise RuntimeError("this TokenSampler was built with keep_logprobs=False")
        kept = (
            torch.stack(self.steps, dim=1)
            if self.steps
            else response_ids.new_zeros(response_ids.shape, dtype=torch.float32)
        )
        if kept.shape != response_ids.shape:  # generate skipped the processor at some step: a transformers change
            raise RuntimeError(
                f"sampler log-probs cover {tuple(kept.shape)} of responses {tuple(response_ids.shape)}; "
                "use rollout.behaviour_logprobs: recompute"
            )
        return torch.where(mask.bool(), kept, 0.0)  # not a product: a pad's -inf log-prob times 0 is NaN
