"""Rollouts: generation, behaviour log-probs, top_k/top_p truncation (top_k 1 is greedy; every sampled
token inside the top k / the nucleus), seeding and metrics. Layout and masks: test_sequences.py; prompt
rendering: test_prompts.py.

Tolerance of "behaviour log-probs equal a fresh forward": 1e-5 absolute, fp32 on CPU. The behaviour
log-probs come from a batched forward over left-padded prompts with explicit position ids; the fresh
forward runs each sequence alone without any padding, so the two differ only in summation order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from astrai.rollout.generation import behaviour_logprobs_source, generate_rollout, sampling_seed
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.scoring import PlainForward, batches_of
from astrai.rollout.sequences import join_sequences, left_pad, response_mask, truncated_rows
from astrai.training.step_metrics import rollout_metrics
from tests.unit.rollout_fixtures import PlainEngine, behaviour_scoring, tiny_model, tiny_tokenizer

EOS, PAD = 3, 0
ATOL = 1e-5


def settings(**changes):
    values = dict(group_size=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)
    values.update(changes)
    return SimpleNamespace(**values)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer).eval()


def prompts_of(tokenizer, texts):
    messages = [[{"role": "user", "content": text}] for text in texts]
    return [render_prompt(tokenizer, chat) for chat in messages], messages


def test_frozen_logprobs_equal_a_fresh_unpadded_forward(model):
    prompt_ids, prompt_mask = left_pad([[4, 5, 6, 7, 8], [9, 10], [11, 12, 13]], PAD)
    response_ids = torch.tensor([[14, 15, EOS, PAD], [16, 17, 18, 19], [EOS, PAD, PAD, PAD]])
    sequences = join_sequences(prompt_ids, prompt_mask, response_ids, response_mask(response_ids, EOS))
    batched = PlainForward(temperature=1.0, micro_batches=batches_of(2)).frozen_logprobs(model, sequences)
    for row in range(3):
        prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
        response = response_ids[row][sequences["response_mask"][row].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        expected = [
            torch.log_softmax(logits[len(prompt) - 1 + t], -1)[token].item() for t, token in enumerate(response)
        ]
        assert batched[row, : len(response)].tolist() == pytest.approx(expected, abs=ATOL)
        assert batched[row, len(response) :].abs().sum() == 0  # padding holds exact zeros
    hot = PlainForward(temperature=2.0, micro_batches=batches_of(3)).frozen_logprobs(model, sequences)
    assert not torch.allclose(hot, batched)  # temperature-scaled logits give other log-probs


# ----------------------------------------------------------------------------- generation


def test_rollout_shapes_groups_and_behaviour_logprobs(model, tokenizer):
    prompt_ids, messages = prompts_of(tokenizer, ["1+2=", "10+20=", "7-3="])
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}, {"prompt": "7-3=", "answer": "4"}]
    result = generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompt_ids, messages, rows),
        settings(),
        seed=5,
        scoring=behaviour_scoring(settings(), tokenizer, 4),
    )
    n, longest = 9, max(len(ids) for ids in prompt_ids)
    assert result.size == n and result.group_size == 3
    assert result.policy_version == 0  # the caller's to set: generation does not know the weights' updates
    assert result.prompt_ids.shape == result.prompt_mask.shape == (n, longest)
    width = result.response_ids.shape[1]
    assert 1 <= width <= 6 and result.response_mask.shape == result.behaviour_logprobs.shape == (n, width)
    for index in range(n):  # groups are contiguous: rows 3k..3k+2 answer prompt k
        prompt = result.prompt_ids[index][result.prompt_mask[index].bool()].tolist()
        assert (
            prompt == prompt_ids[index // 3]
            and result.rows[index] == rows[index // 3]
            and result.messages[index] == messages[index // 3]
        )
    assert result.prompt_texts[0].endswith("<|im_start|>assistant\n")
    # The mask is the rule of `response_mask`, and truncation is "no EOS".
    assert torch.equal(result.response_mask, response_mask(result.response_ids, tokenizer.eos_token_id))
    assert torch.equal(result.truncated, truncated_rows(result.response_ids, tokenizer.eos_token_id))
    assert result.response_texts[0] == tokenizer.decode(
        result.response_ids[0][result.response_mask[0].bool()].tolist(), skip_special_tokens=True
    )
    # Behaviour log-probs = a fresh forward of the same weights on each sequence alone.
    for index in (0, 4, 8):
        prompt = prompt_ids[index // 3]
        response = result.response_ids[index][result.response_mask[index].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], -1)
        expected = expected.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        assert result.behaviour_logprobs[index, : len(response)].tolist() == pytest.approx(expected.tolist(), abs=ATOL)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 4}, {"temperature": 1.3, "top_p": 0.5}])
def test_sampler_behaviour_logprobs_equal_the_recomputed_ones(model, tokenizer, sampling):
    """`rollout.behaviour_logprobs: sampler` keeps what generate saw: the same responses (the processor only
    reads), log-probs under the full temperature-scaled softmax (not the truncated one that was sampled), 0 on pads."""
    prompt_ids, messages = prompts_of(tokenizer, ["1+2=", "10+20=", "7-3="])

    def rollout(source):
        knobs = settings(behaviour_logprobs=source, max_new_tokens=12, **sampling)
        prompts = Prompts(prompt_ids, messages, [{}, {}, {}])
        return generate_rollout(
            PlainEngine(model), tokenizer, prompts, knobs, seed=11, scoring=behaviour_scoring(knobs, tokenizer, 4)
        )

    recomputed, sampled = rollout("recompute"), rollout("sampler")
    assert torch.equal(sampled.response_ids, recomputed.response_ids) and torch.equal(
        sampled.response_mask, recomputed.response_mask
    )
    assert sampled.response_mask.sum() > 12
    if not sampling:  # untruncated, this random model ends some responses early: pads to keep at 0
        assert not sampled.response_mask.all()
    assert sampled.behaviour_logprobs.dtype == torch.float32
    assert torch.allclose(sampled.behaviour_logprobs, recomputed.behaviour_logprobs, atol=ATOL)
    assert (sampled.behaviour_logprobs[sampled.response_mask == 0] == 0).all()
    assert (sampled.behaviour_logprobs[sampled.response_mask == 1] < 0).all()


def test_auto_behaviour_logprobs_come_from_the_sampler_in_fp32_only(model, tokenizer):
    """`auto` (the default): fp32 keeps the sampler's log-probs (no forward of the engine after sampling);
    bf16/fp16, or an engine that does not say, recompute them; an explicit choice is kept whatever the precision."""
    assert [behaviour_logprobs_source("auto", precision) for precision in ("fp32", "bf16", "fp16", None)] == [
        "sampler",
        "recompute",
        "recompute",
        "recompute",
    ]
    assert (
        behaviour_logprobs_source("recompute", "fp32") == "recompute"
        and behaviour_logprobs_source("sampler", "bf16") == "sampler"
    )
    prompt_ids, messages = prompts_of(tokenizer, ["1+2=", "7-3="])

    class CountingEngine(PlainEngine):
        forwards = 0

        def __call__(self, **inputs):  # the recompute forward; sampling runs on generation_module()
            CountingEngine.forwards += 1
            return super().__call__(**inputs)

    results = {}
    for precision in ("fp32", "bf16"):
        engine, CountingEngine.forwards = CountingEngine(model), 0
        engine.precision = precision  # the label only: the model computes in fp32 either way
        results[precision] = generate_rollout(
            engine,
            tokenizer,
            Prompts(prompt_ids, messages, [{}, {}]),
            settings(behaviour_logprobs="auto", max_new_tokens=8),
            seed=2,
            scoring=behaviour_scoring(settings(), tokenizer, 8),
        )
        assert CountingEngine.forwards == (0 if precision == "fp32" else 1), precision
    assert torch.equal(results["fp32"].response_ids, results["bf16"].response_ids)
    assert torch.allclose(results["fp32"].behaviour_logprobs, results["bf16"].behaviour_logprobs, atol=ATOL)


def test_inverse_cdf_sampling_by_hand():
    """Token i owns [cdf[i-1], cdf[i]) of u x total: zero-probability tokens (masked by top_k/top_p) own nothing,
    and u just below 1 stays on the last token of positive probability."""
    from astrai.rollout.token_sampler import inverse_cdf_sample

    probabilities = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]] * 6, dtype=torch.float64)
    uniforms = torch.tensor([0.0, 0.05, 0.1 + 1e-9, 0.69, 0.71, 1.0 - 2**-24])
    assert inverse_cdf_sample(probabilities, uniforms).tolist() == [0, 0, 2, 2, 3, 3]
    truncated = torch.tensor([[0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    assert inverse_cdf_sample(truncated, torch.tensor([0.0])).tolist() == [1]
    assert inverse_cdf_sample(truncated, torch.tensor([1.0 - 2**-24])).tolist() == [2]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(temperature=1.0, top_k=0, top_p=1.0),
        dict(temperature=0.5, top_k=3, top_p=1.0),
        dict(temperature=2.0, top_k=0, top_p=0.6),
    ],
)
def test_the_token_sampler_draws_from_the_warped_distribution(knobs):
    """20,000 draws from one row of logits, against the distribution computed here by hand: softmax at the
    temperature, then the top k kept, then the smallest nucleus of mass >= top_p, renormalised."""
    from astrai.rollout.token_sampler import TokenSampler

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    probabilities = torch.softmax(logits / knobs["temperature"], -1)
    order = probabilities.argsort(descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    mass = 0.0
    for rank, index in enumerate(order.tolist()):
        if (knobs["top_k"] and rank >= knobs["top_k"]) or mass >= knobs["top_p"] or probabilities[index] == 0:
            break
        keep[index], mass = True, mass + probabilities[index].item()
    expected = torch.where(keep, probabilities, 0.0) / probabilities[keep].sum()
    draws = 20_000
    sampler = TokenSampler(**knobs, keep_logprobs=True)
    torch.manual_seed(0)
    chosen = sampler(torch.zeros(draws, 1, dtype=torch.long), logits.expand(draws, 6).clone())
    assert torch.isinf(chosen).sum(-1).eq(5).all() and chosen.max(-1).values.eq(0).all()  # one token left per row, at 0
    tokens = chosen.argmax(-1)
    frequencies = torch.bincount(tokens, minlength=6).double() / draws
    tolerance = 4 * (expected * (1 - expected) / draws).sqrt() + 1e-12
    assert ((frequencies - expected.double()).abs() <= tolerance).all(), (frequencies, expected)
    assert frequencies[~keep].sum() == 0  # nothing outside the top k / the nucleus, never the -inf token
    # Drawn in chunks of rows (bounded float64 memory), the same uniforms give the same tokens.
    torch.manual_seed(0)
    chunked = TokenSampler(**knobs, keep_logprobs=False, chunk_elements=6 * 7)(
        torch.zeros(draws, 1, dtype=torch.long), logits.expand(draws, 6).clone()
    )
    assert torch.equal(chunked.argmax(-1), tokens)
    # The kept log-prob is the token's under the full softmax at the temperature, not the truncated one.
    kept = sampler.logprobs(tokens[:, None], torch.ones(draws, 1))
    assert torch.allclose(kept[:, 0], torch.log_softmax(logits / knobs["temperature"], -1)[tokens], atol=1e-6)


def test_sampler_logprobs_are_zero_on_pads_and_refuse_a_step_count_mismatch():
    from astrai.rollout.token_sampler import TokenSampler

    sampler = TokenSampler(1.0, 0, 1.0, keep_logprobs=True)
    torch.manual_seed(1)
    for _ in range(2):
        sampler(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[0.0, 2.0, float("-inf")], [1.0, 1.0, 1.0]]))
    logprobs = sampler.logprobs(torch.tensor([[1, 0], [2, 0]]), torch.tensor([[1, 0], [1, 1]]))
    assert logprobs[0, 1] == 0 and (logprobs[logprobs != 0] < 0).all() and not torch.isnan(logprobs).any()
    with pytest.raises(RuntimeError, match="use rollout.behaviour_logprobs: recompute"):
        sampler.logprobs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="keep_logprobs=False"):
        TokenSampler(1.0, 0, 1.0, keep_logprobs=False).logprobs(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))


def test_max_length_truncates_and_marks(model, tokenizer):
    prompt_ids, messages = prompts_of(tokenizer, ["1+2="])
    result = generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompt_ids, messages, [{}]),
        settings(group_size=8, max_new_tokens=2),
        seed=1,
        scoring=behaviour_scoring(settings(), tokenizer, 8),
    )
    assert result.response_ids.shape[1] <= 2
    lengths = result.response_mask.sum(dim=1)
    for row in range(8):  # a row is either cut at 2 tokens without EOS or ended by an EOS
        ended = (result.response_ids[row][: lengths[row]] == tokenizer.eos_token_id).any().item()
        assert ended != result.truncated[row].item()
        assert result.truncated[row].item() <= (lengths[row].item() == 2)


def test_sampling_is_seeded_per_rollout_and_ignores_model_generation_defaults(model, tokenizer):
    prompt_ids, messages = prompts_of(tokenizer, ["5+5="])
    engine = PlainEngine(model)
    model.generation_config.top_k = 1  # a model default that would make sampling greedy
    model.generation_config.repetition_penalty = 10.0
    try:

        def run(seed):
            return generate_rollout(
                engine,
                tokenizer,
                Prompts(prompt_ids, messages, [{}]),
                settings(group_size=8),
                seed=seed,
                scoring=behaviour_scoring(settings(), tokenizer, 8),
            )

        first, again, other = run(11), run(11), run(12)
    finally:
        model.generation_config.top_k, model.generation_config.repetition_penalty = None, None
    assert torch.equal(first.response_ids, again.response_ids)
    assert not torch.equal(first.response_ids, other.response_ids)
    assert len(set(first.response_texts)) > 1  # not greedy: top_k 0 of our settings won over the model's 1


def greedy_continuation(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Argmax decoding by hand, one full forward per token (no generate, no cache): up to and including EOS."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt) :]


def sampled_token_standing(model, result, prompt_ids) -> tuple[list[int], list[float]]:
    """For each valid response token: how many tokens the model found likelier there, and their probability mass."""
    ranks, masses = [], []
    for index in range(result.size):
        prompt = prompt_ids[index // result.group_size]
        response = result.response_ids[index][result.response_mask[index].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[
                0, len(prompt) - 1 : len(prompt) - 1 + len(response)
            ]
        probabilities = torch.softmax(logits.double(), dim=-1)
        for position, token in enumerate(response):
            likelier = probabilities[position] > probabilities[position, token]
            ranks.append(int(likelier.sum()))
            masses.append(float(probabilities[position][likelier].sum()))
    return ranks, masses


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"top_p": 1e-3}])
def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_response(model, tokenizer, truncation):
    prompt_ids, messages = prompts_of(tokenizer, ["5+5=", "12-3="])
    result = generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompt_ids, messages, [{}, {}]),
        settings(group_size=4, **truncation),
        seed=7,
        scoring=behaviour_scoring(settings(), tokenizer, 8),
    )
    for index in range(result.size):
        response = result.response_ids[index][result.response_mask[index].bool()].tolist()
        assert response == greedy_continuation(model, prompt_ids[index // 4], 6, tokenizer.eos_token_id), index
    plain = generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompt_ids, messages, [{}, {}]),
        settings(group_size=4),
        seed=7,
        scoring=behaviour_scoring(settings(), tokenizer, 8),
    )
    assert len(set(plain.response_texts)) > 2  # the same seed without truncation samples diverse responses


def test_top_k_and_top_p_restrict_each_sampled_token(model, tokenizer):
    prompt_ids, messages = prompts_of(tokenizer, ["5+5=", "12-3="])

    def standing(**truncation):
        result = generate_rollout(
            PlainEngine(model),
            tokenizer,
            Prompts(prompt_ids, messages, [{}, {}]),
            settings(group_size=8, **truncation),
            seed=3,
            scoring=behaviour_scoring(settings(), tokenizer, 8),
        )
        return sampled_token_standing(model, result, prompt_ids)

    ranks, masses = standing()
    assert max(ranks) >= 3 and max(masses) > 0.5  # untruncated: tokens far down the distribution occur
    ranks, _ = standing(top_k=3)
    assert max(ranks) <= 2 and len(set(ranks)) > 1  # only the 3 likeliest, and not only the first
    _, masses = standing(top_p=0.3)
    assert max(masses) < 0.3  # inside the nucleus: the likelier tokens hold less than top_p
    assert sum(mass > 0 for mass in masses) > 0  # and not only the argmax


def test_rollout_leaves_the_global_rng_alone(model, tokenizer):
    prompt_ids, messages = prompts_of(tokenizer, ["5+5="])
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompt_ids, messages, [{}]),
        settings(),
        seed=1,
        scoring=behaviour_scoring(settings(), tokenizer, 4),
    )
    assert torch.equal(torch.rand(3), expected)
    assert model.training is False  # restored to the mode it had


def test_sampling_seed_is_distinct_per_step_rank_and_stream():
    seeds = {sampling_seed(42, step, rank, stream) for step in range(20) for rank in range(4) for stream in range(3)}
    assert len(seeds) == 20 * 4 * 3
    assert sampling_seed(42, 3, 1) == sampling_seed(42, 3, 1) and sampling_seed(42, 3, 1) != sampling_seed(43, 3, 1)


def test_rollout_metrics_from_global_sums():
    # Two ranks' sums: rewards {1, 0} and {1, 1}; 4 responses of 3, 1, 2, 2 tokens, one truncated.
    totals = {
        "rollout/responses": 4.0,
        "rollout/response_tokens": 8.0,
        "rollout/truncated": 1.0,
        "rollout/reward": 3.0,
        "rollout/reward_squared": 3.0,
        "rollout/reward_exact": 2.0,
    }
    record = rollout_metrics(totals)
    assert record["reward_mean"] == pytest.approx(0.75)
    assert record["reward_std"] == pytest.approx((0.75 - 0.75**2) ** 0.5)  # population std of {1, 0, 1, 1}
    assert record["response_len_mean"] == 2.0 and record["truncated_frac"] == 0.25 and record["reward_exact"] == 0.5
