"""`rl.packing`: grpo's and online_ppo's forwards (policy, reference, critic) without their padding give the
same frozen targets, losses and gradients as the padded forwards (fp32, CPU, within 1e-5)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from astrai.algos import FixedKLController
from astrai.data.packing import SEGMENT_ATTENTION, attention_of
from astrai.models.segment_attention import use_segment_attention
from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.generation import generate_rollout
from astrai.rollout.packed import pack_padded
from astrai.rollout.prompts import render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.rollout.sequences import response_forward
from astrai.strategies.grpo import GrpoStrategy
from astrai.strategies.online import batch_geometry
from astrai.strategies.ppo import PPOStrategy
from tests.unit.rollout_fixtures import LengthReward, PlainEngine, online_job, tiny_model, tiny_tokenizer

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


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
        prompts,
        chats,
        [{}, {}],
        rollout_settings,
        seed=5,
        policy_version=0,
        logprob_batch_size=2,
    )
    lengths = result.response_mask.sum(dim=1)
    assert lengths.min() < lengths.max()  # ragged responses: the padded batch holds padding to remove
    return result, policy, reference


def setup(strategy, config, reference):
    strategy.geometry = batch_geometry(config, 1)
    strategy.dist = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    strategy.reward = WeightedReward([(LengthReward(), 1.0)])
    strategy.reference = PlainEngine(reference)
    return strategy


def grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(padded: dict, packed: dict) -> None:
    assert padded.keys() == packed.keys()
    for name, gradient in padded.items():
        torch.testing.assert_close(packed[name], gradient, atol=1e-5, rtol=0, msg=name)


def assert_same_targets(padded: dict, packed: dict) -> None:
    assert padded.keys() == packed.keys()
    for key, value in padded.items():
        torch.testing.assert_close(packed[key], value, atol=1e-5, rtol=0, msg=key)


def test_pack_padded_keeps_only_attended_tokens(rollout_and_models):
    result, _, _ = rollout_and_models
    sequences = result.training_tensors()
    inputs, keep, scored = pack_padded(sequences)
    assert inputs["input_ids"].shape[1] == int(sequences["attention_mask"].sum())
    assert len(keep) == int(scored.sum()) == int(sequences["response_mask"].sum())
    assert inputs["position_ids"][0, 0] == 0 and (inputs["position_ids"] == 0).sum() == len(result.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_response_logits_equal_padded(rollout_and_models, temperature):
    result, policy, _ = rollout_and_models
    sequences = result.training_tensors()
    mask = sequences["response_mask"].bool()
    with torch.no_grad():
        padded = response_forward(policy, sequences, temperature, 40)[0]
        packed = response_forward(policy, sequences, temperature, 40, packed=True)[0]
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_packed_response_logits_with_segment_attention_equal_padded(rollout_and_models):
    result, policy, _ = rollout_and_models
    segment = copy.deepcopy(policy)
    assert use_segment_attention(segment)
    sequences = result.training_tensors()
    mask = sequences["response_mask"].bool()
    with torch.no_grad():
        padded = response_forward(policy, sequences, 1.0, 40)[0]
        packed = response_forward(segment, sequences, 1.0, 40, packed=True)[0]
        generated_path = response_forward(segment, sequences, 1.0, 40)[0]  # padded: transformers' sdpa mask
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(generated_path[mask], padded[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("segment", [False, True])
def test_packed_behaviour_logprobs_equal_padded(tokenizer, rollout_and_models, segment):
    """The rollout's recomputed behaviour log-probs: the same samples (same seed) and the same log-probs with
    rl.packing, under transformers' packed mask and under the one-row-at-a-time sdpa."""
    result, policy, _ = rollout_and_models
    model = copy.deepcopy(policy)
    if segment:
        assert use_segment_attention(model)
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4+17=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    settings = online_job("grpo", TINY, rollout={"max_new_tokens": 8}).rollout
    rollouts = [
        generate_rollout(
            PlainEngine(model),
            tokenizer,
            prompts,
            chats,
            [{}, {}],
            settings,
            seed=5,
            policy_version=0,
            logprob_batch_size=2,
            packed=packed,
        )
        for packed in (False, True)
    ]
    assert torch.equal(rollouts[0].response_ids, rollouts[1].response_ids)
    assert torch.equal(rollouts[0].response_ids, result.response_ids)
    torch.testing.assert_close(rollouts[1].behaviour_logprobs, rollouts[0].behaviour_logprobs, atol=1e-5, rtol=0)


def test_grpo_packed_targets_loss_and_gradients_equal_padded(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    losses, gradients, targets = [], [], []
    for packing in (False, True):
        config = online_job("grpo", TINY, rl={"kl_coef": 0.1, "packing": packing, "epochs_per_rollout": 2})
        strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        micro = next(iter(strategy.minibatches(pinned, step=1, epoch=0)))[0]
        normalizer = float(micro["response_mask"].sum()) / 2
        output = strategy.compute_loss(PlainEngine(policy), micro, normalizer)
        losses.append(output)
        gradients.append(grads(policy, output.loss))
    assert_same_targets(*targets)
    assert float(losses[1].loss.detach()) == pytest.approx(float(losses[0].loss.detach()), abs=1e-5)
    for key, value in losses[0].sums.items():
        assert losses[1].sums[key] == pytest.approx(value, abs=1e-4), key
    assert_same_gradients(*gradients)


@pytest.mark.parametrize("segment", [False, True])
def test_online_ppo_packed_policy_reference_and_critic_equal_padded(tokenizer, rollout_and_models, segment):
    """With `segment`, the policy, the reference and the critic's trunk run sdpa one row at a time (as
    build_run switches them with rl.packing); without, transformers' packed mask."""
    result, policy, reference = rollout_and_models
    critic = ValueModel(trunk_of(copy.deepcopy(policy)))
    if segment:
        policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
        assert use_segment_attention(policy) and use_segment_attention(reference)
        assert use_segment_attention(critic.trunk) and attention_of(critic) == SEGMENT_ATTENTION
    torch.manual_seed(2)
    torch.nn.init.normal_(critic.value_head.weight, std=0.02)  # values that are not all 0
    outputs, gradients, targets = [], [], []
    for packing in (False, True):
        config = online_job("online_ppo", TINY, rl={"kl_coef": 0.1, "packing": packing})
        strategy = setup(PPOStrategy(config, tokenizer), config, reference)
        strategy.critic = PlainEngine(critic)
        strategy.kl_controller = FixedKLController(config.rl.kl_coef)
        strategy.loss_kl_coef = config.rl.kl_coef
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        micro = next(iter(strategy.minibatches(pinned, step=1, epoch=0)))[0]
        normalizer = float(micro["response_mask"].sum()) / 2
        policy_output = strategy.compute_loss(PlainEngine(policy), micro, normalizer)
        critic_output = strategy.compute_critic_loss(PlainEngine(critic), micro, normalizer)
        outputs.append((policy_output, critic_output))
        gradients.append((grads(policy, policy_output.loss), grads(critic, critic_output.loss)))
    assert_same_targets(*targets)
    for padded, packed in zip(*outputs):
        assert float(packed.loss.detach()) == pytest.approx(float(padded.loss.detach()), abs=1e-5)
    for padded, packed in zip(*gradients):
        assert_same_gradients(padded, packed)
