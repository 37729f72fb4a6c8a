"""The scoring forward chosen once from the job (astrai/rollout/scoring.py): the factory picks the variant of
rl.packing / rl.share_prefix with the job's temperature and logits chunk size, an online strategy holds that
one object, and the variants give the same log-probs, entropies and critic values (1e-5, fp32) whatever their
micro-batches."""

from __future__ import annotations

import pytest
import torch

from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.scoring import (
    PackedForward,
    PlainForward,
    SharedPrefixForward,
    batches_of,
    scoring_forward,
)
from astrai.rollout.sequences import join_sequences, left_pad, response_mask
from astrai.strategies.grpo import GrpoStrategy
from tests.unit.rollout_fixtures import LLAMA_INIT, online_job, tiny_model, tiny_tokenizer

VARIANTS = (PlainForward, PackedForward, SharedPrefixForward)


@pytest.mark.parametrize(
    ("rl", "variant"),
    [
        ({}, PlainForward),
        ({"packing": True}, PackedForward),
        ({"share_prefix": True}, SharedPrefixForward),  # the schema refuses it with rl.packing
    ],
)
def test_the_factory_picks_the_jobs_variant(rl, variant):
    job = online_job("grpo", LLAMA_INIT, rl=rl, rollout={"temperature": 0.7}, train={"logits_chunk_size": 16})
    scoring = scoring_forward(job, vocab_size=45)
    assert type(scoring) is variant
    assert (scoring.temperature, scoring.vocab_size, scoring.chunk_size) == (0.7, 45, 16)
    strategy = GrpoStrategy(job, tiny_tokenizer())
    assert type(strategy.scoring) is variant and strategy.scoring is strategy.scoring  # built once
    assert strategy.scoring.vocab_size == len(strategy.tokenizer)
    assert strategy.scoring.micro_batches == strategy.forward_batches


@pytest.fixture(scope="module")
def sequences():
    """3 prompts of 3 lengths x 4 responses each, EOS at random, rows shuffled (a replay's permutation)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    repeated = [prompt for prompt in prompts for _ in range(4)]
    prompt_ids, prompt_mask = left_pad(repeated, 0)
    responses = torch.randint(4, 40, (len(repeated), 6), generator=generator)
    responses[1, 2] = responses[6, 0] = 2  # EOS: masks of several lengths
    joined = join_sequences(prompt_ids, prompt_mask, responses, response_mask(responses, 2))
    order = torch.randperm(len(repeated), generator=generator)
    return {key: value[order] for key, value in joined.items()}


def test_every_variant_gives_the_same_logprobs_entropy_and_values(sequences):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    critic = ValueModel(trunk_of(tiny_model(tokenizer, seed=1))).eval()
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    mask = sequences["response_mask"].bool()
    results = {}
    for variant in VARIANTS:
        for micro_batches, chunk_size in ((None, 0), (batches_of(5), 0), (None, 7)):
            scoring = variant(0.7, len(tokenizer) - 1, chunk_size, micro_batches)
            with torch.no_grad():
                logprobs, entropy, _ = scoring.token_statistics(model, sequences, entropy="metric")
                values = scoring.values(critic, sequences)
            frozen = scoring.frozen_logprobs(model, sequences), scoring.frozen_values(critic, sequences)
            results[variant.name, chunk_size, micro_batches is None] = logprobs, entropy, values, *frozen
    expected = results["plain", 0, True]
    assert expected[0].abs().sum() > 0 and expected[2].abs().sum() > 0
    for key, result in results.items():
        logprobs, entropy, values, frozen_logprobs, frozen_values = result
        torch.testing.assert_close(logprobs, expected[0], atol=1e-5, rtol=0, msg=str(key))
        torch.testing.assert_close(entropy[mask], expected[1][mask], atol=1e-5, rtol=0, msg=str(key))
        torch.testing.assert_close(values, expected[2], atol=1e-5, rtol=0, msg=str(key))
        torch.testing.assert_close(frozen_logprobs, expected[0], atol=1e-5, rtol=0, msg=str(key))
        torch.testing.assert_close(frozen_values, expected[2], atol=1e-5, rtol=0, msg=str(key))
        assert (logprobs[~mask] == 0).all() and (values[~mask] == 0).all()
