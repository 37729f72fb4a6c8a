"""One prefill per prompt group (`rollout.share_prefill`): the same seed samples exactly the same tokens as
prefilling every copy, the behaviour log-probs agree within 1e-6 (fp32, CPU), the prompt forward runs once
per group, and the repeated cache holds what the unshared prefill computes.

Why 1e-6 and not bit equality for the `sampler` log-probs: the last prompt token's logits come from a
one-token forward against the cache instead of the full-prompt forward (see shared_prefill.py); the
`recompute` log-probs come from the training forward over the same tokens and are bit-equal.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from astrai.rollout.generation import generate_rollout
from astrai.rollout.group_prefill import group_prefill_cache, shares_prefill
from astrai.rollout.prompts import Prompts
from astrai.rollout.sequences import left_pad
from tests.unit.rollout_fixtures import PlainEngine, behaviour_scoring, tiny_model, tiny_tokenizer

# Left-padded prompts of different lengths in one batch, a one-token prompt among them (its cached
# prefix is all padding).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]


def settings(**changes):
    values = dict(group_size=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, behaviour_logprobs="sampler")
    values.update(changes)
    return SimpleNamespace(**values)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer).eval()


def rollout(model, tokenizer, seed=3, **changes):
    knobs = settings(**changes)
    prompts = Prompts(PROMPTS, [[] for _ in PROMPTS], [{} for _ in PROMPTS])
    scoring = behaviour_scoring(knobs, tokenizer, 8)
    return generate_rollout(PlainEngine(model), tokenizer, prompts, knobs, seed=seed, scoring=scoring)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.6}, {"max_new_tokens": 3}],
    ids=["plain", "top_k", "top_p", "truncating"],
)
@pytest.mark.parametrize("source", ["sampler", "recompute"])
def test_shared_prefill_samples_the_same_tokens_and_logprobs(model, tokenizer, sampling, source):
    for seed in (3, 4, 5):
        shared = rollout(model, tokenizer, seed, share_prefill=True, behaviour_logprobs=source, **sampling)
        unshared = rollout(model, tokenizer, seed, share_prefill=False, behaviour_logprobs=source, **sampling)
        assert torch.equal(shared.response_ids, unshared.response_ids), seed
        assert torch.equal(shared.response_mask, unshared.response_mask)
        assert torch.equal(shared.truncated, unshared.truncated)
        assert torch.equal(shared.prompt_ids, unshared.prompt_ids)
        difference = (shared.behaviour_logprobs - unshared.behaviour_logprobs).abs().max().item()
        assert difference <= (1e-6 if source == "sampler" else 0.0), (seed, difference)
    # Not a vacuous comparison: the groups' responses differ, and (untruncated) some end early at EOS.
    assert len({tuple(row.tolist()) for row in shared.response_ids}) > len(PROMPTS)
    if "max_new_tokens" not in sampling and "top_k" not in sampling:
        assert not shared.response_mask.all() and shared.response_mask.sum() > 20


def test_each_prompt_is_prefilled_once_per_group(model, tokenizer):
    """The multi-token forward (the prefill) sees one row per prompt with sharing, one per response without;
    every later forward is one token for every response."""
    shapes = []
    hook = model.model.register_forward_hook(
        lambda module, args, kwargs, output: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        for share in (True, False):
            shapes.clear()
            result = rollout(model, tokenizer, share_prefill=share, behaviour_logprobs="sampler")
            longest, rows = max(map(len, PROMPTS)), result.size
            prefills = [shape for shape in shapes if shape[1] > 1]
            if share:
                assert prefills == [(len(PROMPTS), longest - 1)]
                assert shapes[1:] == [(rows, 1)] * (len(shapes) - 1)  # the last prompt token, then decoding
                assert len(shapes) == result.response_ids.shape[1] + 1
            else:
                assert prefills == [(rows, longest)] and len(shapes) == result.response_ids.shape[1]
    finally:
        hook.remove()


def test_the_repeated_cache_holds_the_unshared_prefill(model, tokenizer):
    group = 3
    ids, mask = left_pad([row for row in PROMPTS for _ in range(group)], tokenizer.pad_token_id)
    cache = group_prefill_cache(model, ids, mask, group)
    with torch.no_grad():
        positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
        full = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions, use_cache=True).cache
    assert cache.get_seq_length() == ids.shape[1] - 1
    for shared_layer, full_layer in zip(cache.layers, full.layers):
        assert shared_layer.keys.shape == full_layer.keys.shape
        real = mask[:, None, :-1, None].bool()  # pad positions are never attended: only the real ones must agree
        for shared_tensor, full_tensor in (
            (shared_layer.keys, full_layer.keys),
            (shared_layer.values, full_layer.values),
        ):
            assert torch.allclose(shared_tensor * real, full_tensor * real, atol=1e-6)


def test_groups_of_different_rows_are_refused(model, tokenizer):
    ids, mask = left_pad([[5, 6], [5, 6], [7, 8], [9, 8]], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="not 2 groups of 2 identical rows"):
        group_prefill_cache(model, ids, mask, 2)


def test_sharing_needs_the_setting_groups_two_prompt_columns_and_a_dynamic_cache(model):
    two_columns, one_column = torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long)
    assert shares_prefill(settings(), 4, two_columns, model, synced=False)
    assert shares_prefill(SimpleNamespace(), 4, two_columns, model, synced=False)  # default on, as the config's
    assert not shares_prefill(settings(share_prefill=False), 4, two_columns, model, synced=False)
    assert not shares_prefill(settings(), 1, two_columns, model, synced=False)  # nothing to share
    assert not shares_prefill(settings(), 4, one_column, model, synced=False)  # the cache would hold nothing
    recurrent = SimpleNamespace(_supports_default_dynamic_cache=lambda: False)  # e.g. Mamba: generate makes no cache
    assert not shares_prefill(settings(), 4, two_columns, recurrent, synced=False)


# Families whose caches, position handling or attention differ from Llama's (learned positions, OPT's offset,
# GPT-NeoX's partial rotary, q/k norms, Gemma's scaled embeddings, MoE layers); tiny, as the architecture matrix.
ATTENTION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_inner": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "opt": {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64, "word_embed_proj_dim": 32, "num_attention_heads": 4},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4},
    "qwen3": {"model_type": "qwen3", **ATTENTION, "head_dim": 8},
    "gemma": {"model_type": "gemma", **ATTENTION, "head_dim": 8},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **ATTENTION,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
}


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefill_across_model_families(tokenizer, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    init = dict(FAMILIES[family])
    extra = {"num_hidden_layers": 2, "max_position_embeddings": 64} if family != "gpt2" else {}
    config = AutoConfig.for_model(
        init.pop("model_type"),
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **init,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    shared = rollout(model, tokenizer, share_prefill=True, group_size=3)
    unshared = rollout(model, tokenizer, share_prefill=False, group_size=3)
    assert torch.equal(shared.response_ids, unshared.response_ids)
    assert (shared.behaviour_logprobs - unshared.behaviour_logprobs).abs().max() <= 1e-6
