"""rl.share_prefix (astrai/rollout/prefix_scoring.py): each distinct prompt of a micro-batch runs once and its
responses run against its keys and values. The log-probs, the entropies and the gradients must equal the full
forward's within 1e-5 (fp32), whatever the order of the rows, with left-padded prompts of several lengths, a
one-column prompt, and a peft (LoRA) policy; a model it cannot serve falls back to the plain forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.prefix_scoring import shared_prompt_forward, shares_prompt
from astrai.rollout.scoring import PlainForward, SharedPrefixForward, batches_of
from astrai.rollout.sequences import join_sequences, left_pad, response_mask
from tests.unit.rollout.test_sequences import SCORING_LLAMA
from tests.unit.rollout_fixtures import LLAMA_SHAPE

EOS, PAD, VOCAB = 3, 0, SCORING_LLAMA.vocab_size


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(SCORING_LLAMA).float()


def grouped_sequences(prompts: list[list[int]], group: int, response_len: int = 5, seed: int = 1) -> dict:
    """group responses to each prompt, rows in a shuffled order (a minibatch's permutation), EOS at random."""
    generator = torch.Generator().manual_seed(seed)
    repeated = [prompt for prompt in prompts for _ in range(group)]
    prompt_ids, prompt_mask = left_pad(repeated, PAD)
    responses = torch.randint(4, VOCAB - 2, (len(repeated), response_len), generator=generator)
    ends = torch.randint(1, response_len + 1, (len(repeated),), generator=generator)
    for row, end in enumerate(ends.tolist()):
        if end < response_len:
            responses[row, end - 1] = EOS
            responses[row, end:] = PAD
    sequences = join_sequences(prompt_ids, prompt_mask, responses, response_mask(responses, EOS))
    order = torch.randperm(len(repeated), generator=generator)
    return {key: value[order] for key, value in sequences.items()}


def scoring(shared: bool, **settings):
    """The shared-prefix scoring forward, or the plain one it must equal."""
    return (SharedPrefixForward if shared else PlainForward)(**settings)


def statistics(model, sequences, shared: bool):
    return scoring(shared, temperature=0.7, vocab_size=VOCAB - 2).token_statistics(model, sequences, entropy="trained")


def gradients(model) -> list[torch.Tensor]:
    return [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


@pytest.mark.parametrize(
    "prompts",
    [
        [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]],  # left padding of three lengths
        [[5], [6], [7]],  # one-column prompts: the prefix is a masked column
    ],
)
def test_equal_to_the_full_forward_values_and_gradients(prompts):
    model = tiny_llama()
    sequences = grouped_sequences(prompts, group=4)
    mask = sequences["response_mask"].bool()
    results = {}
    for shared in (False, True):
        model.zero_grad()
        logprobs, entropy, _ = statistics(model, sequences, shared)
        (logprobs.sum() + 0.1 * (entropy * mask).sum()).backward()
        results[shared] = logprobs.detach(), entropy.detach(), gradients(model)
    (plain_logprobs, plain_entropy, plain_grads), (logprobs, entropy, grads) = results[False], results[True]
    torch.testing.assert_close(logprobs, plain_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[mask], plain_entropy[mask], atol=1e-5, rtol=0)
    assert len(grads) == len(plain_grads) == len(list(model.parameters()))
    for grad, plain in zip(grads, plain_grads):
        torch.testing.assert_close(grad, plain, atol=1e-5, rtol=1e-4)
    assert (logprobs[~mask] == 0).all()


def test_the_prompt_runs_once_per_distinct_prompt():
    """The first forward sees the distinct prompts (3 rows, all but the last prompt column); the second every
    sequence's last prompt token and response (12 rows, R columns)."""
    model = tiny_llama()
    sequences = grouped_sequences([[5, 6, 7, 8], [9, 10], [11, 12, 13]], group=4, response_len=5)
    shapes = []
    handle = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape))
    )
    logits, _ = shared_prompt_forward(model, sequences)
    handle.remove()
    assert shapes == [(3, 3), (12, 5)]
    assert logits.shape == (12, 5, VOCAB)


def test_no_grad_scoring_in_batches_equals_the_plain_scoring():
    model = tiny_llama().eval()
    sequences = grouped_sequences([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], group=3)
    options = {"temperature": 1.0, "micro_batches": batches_of(4), "vocab_size": VOCAB}
    plain = PlainForward(**options).frozen_logprobs(model, sequences)
    shared = SharedPrefixForward(**options).frozen_logprobs(model, sequences)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_peft_policy_equal_values_and_lora_gradients():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for lora in (parameter for name, parameter in model.named_parameters() if "lora_B" in name):
        torch.nn.init.normal_(lora, std=0.1)  # B = 0 at init would make every LoRA A gradient 0
    assert shares_prompt(model, {})
    sequences = grouped_sequences([[5, 6, 7, 8], [9, 10, 11]], group=3)
    results = {}
    for shared in (False, True):
        model.zero_grad()
        logprobs, _, _ = scoring(shared).token_statistics(model, sequences)
        logprobs.sum().backward()
        results[shared] = logprobs.detach(), gradients(model)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    assert len(results[True][1]) == 8  # A and B of q and v in 2 layers: only LoRA trains
    for grad, plain in zip(results[True][1], results[False][1]):
        assert grad.abs().sum() > 0
        torch.testing.assert_close(grad, plain, atol=1e-5, rtol=1e-4)


def test_models_it_cannot_serve_take_the_plain_forward():
    """Sliding-window layers, forward options (a mixture of experts' router logits) and gradient checkpointing
    in training are served by the plain forward, which gives the same log-probs."""
    assert shares_prompt(tiny_llama(), {})
    assert not shares_prompt(tiny_llama(), {"output_router_logits": True})
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, **LLAMA_SHAPE, sliding_window=4))
    assert not shares_prompt(windowed, {})
    checkpointed = tiny_llama()
    checkpointed.activation_checkpointing_enable()
    checkpointed.train()
    assert not shares_prompt(checkpointed, {})
    with torch.no_grad():
        assert shares_prompt(checkpointed, {})  # no backward to replay: the cache is kept
    sequences = grouped_sequences([[5, 6, 7], [8, 9]], group=2)
    plain = PlainForward().token_statistics(windowed, sequences)[0]
    torch.testing.assert_close(SharedPrefixForward().token_statistics(windowed, sequences)[0], plain)


def test_chunked_output_layer_on_the_shared_forward():
    """train.logits_chunk_size: the second forward's output layer computes the statistics chunk by chunk; they
    equal the plain full-logits path, gradients included."""
    model = tiny_llama()
    sequences = grouped_sequences([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], group=4)
    results = {}
    for shared, chunk in ((False, 0), (True, 7)):
        model.zero_grad()
        forward = scoring(shared, vocab_size=VOCAB - 2, chunk_size=chunk)
        logprobs, entropy, output = forward.token_statistics(model, sequences, entropy="trained")
        (logprobs.sum() + entropy[sequences["response_mask"].bool()].sum()).backward()  # chunks skip padding
        results[shared] = logprobs.detach(), gradients(model), output.logits.shape
    assert results[True][2] == (12, 5, 2)  # the chunked layer's statistics (log-prob, entropy), not the logits
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    for grad, plain in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(grad, plain, atol=1e-5, rtol=1e-4)


def test_critic_values_and_gradients_equal_the_full_forward():
    """online_ppo's critic (trunk + value head) takes the same two forwards: its R values are the states in which
    the response tokens are chosen, as the full forward's cut gives them."""
    critic = ValueModel(trunk_of(tiny_llama()))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    assert shares_prompt(critic, {})
    sequences = grouped_sequences([[5, 6, 7, 8, 9], [10, 11], [12]], group=3)
    results = {}
    for shared in (False, True):
        critic.zero_grad()
        values = scoring(shared).values(critic, sequences)
        (values**2).sum().backward()
        results[shared] = values.detach(), gradients(critic)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    assert results[False][0].abs().sum() > 0
    assert len(results[True][1]) == len(results[False][1]) == len(list(critic.parameters()))
    for grad, plain in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(grad, plain, atol=1e-5, rtol=1e-4)
