"""Fixtures the online strategies' tests share (rl.packing's and rl.share_prefix's): a tiny tokenizer, and a
rollout of two prompts of different lengths with the policy and reference models that scored it."""

from __future__ import annotations

import pytest

from astrai.rollout.generation import generate_rollout
from astrai.rollout.prompts import Prompts, render_prompt
from tests.unit.rollout_fixtures import (
    LLAMA_INIT,
    PlainEngine,
    behaviour_scoring,
    online_job,
    tiny_model,
    tiny_tokenizer,
)

TINY = LLAMA_INIT


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rollout_and_models(tokenizer):
    policy = tiny_model(tokenizer, seed=0)
    reference = tiny_model(tokenizer, seed=1)
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4+17=")]  # prompts of two lengths
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    rollout_settings = online_job("grpo", TINY, rollout={"max_new_tokens": 8}).rollout
    result = generate_rollout(
        PlainEngine(policy),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        rollout_settings,
        seed=5,
        scoring=behaviour_scoring(rollout_settings, tokenizer, 2),
    )
    lengths = result.response_mask.sum(dim=1)
    assert lengths.min() < lengths.max()  # ragged responses: the padded batch holds padding to remove
    return result, policy, reference
