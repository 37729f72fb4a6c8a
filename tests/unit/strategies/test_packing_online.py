"""`rl.packing`: grpo's and online_ppo's forwards (policy, reference, critic) without their padding give the
same frozen targets, losses and gradients as the padded forwards (fp32, CPU, within 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch

from astrai.algos import FixedKLController
from astrai.config import ConfigError
from astrai.data.packing import SEGMENT_ATTENTION, PackingError, attention_of
from astrai.engine import DistInfo
from astrai.models.segment_attention import use_segment_attention
from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.generation import generate_rollout
from astrai.rollout.packed_scoring import pack_padded, token_micro_batches
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.rollout.scoring import PackedForward, PlainForward
from astrai.strategies.grpo import GrpoStrategy
from astrai.strategies.online_base import batch_geometry
from astrai.strategies.ppo import PPOStrategy
from tests.unit.rollout_fixtures import (
    LLAMA_INIT,
    LengthReward,
    PlainEngine,
    behaviour_scoring,
    online_job,
)

TINY = LLAMA_INIT


def setup(strategy, config, reference):
    strategy.geometry = batch_geometry(config, 1)
    strategy.dist = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    strategy.reward = WeightedReward([(LengthReward(), 1.0)])
    strategy.reference = PlainEngine(reference)
    return strategy


def ppo_setup(config, tokenizer, reference, critic) -> PPOStrategy:
    """An online_ppo strategy as `setup` makes grpo's, with its critic and a fixed KL coefficient."""
    strategy = setup(PPOStrategy(config, tokenizer), config, reference)
    strategy.critic = PlainEngine(critic)
    strategy.kl_controller = FixedKLController(config.rl.kl_coef)
    strategy.loss_kl_coef = config.rl.kl_coef
    return strategy


def ppo_updates(strategy, pinned, policy, critic) -> tuple:
    """The policy's and the critic's updates (`minibatch_update`) of the first minibatch."""
    micro_batches = first_minibatch(strategy, pinned)
    return (
        minibatch_update(strategy, strategy.compute_loss, policy, micro_batches),
        minibatch_update(strategy, strategy.compute_critic_loss, critic, micro_batches),
    )


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
        padded = PlainForward(temperature, 40).logits(policy, sequences)[0]
        packed = PackedForward(temperature, 40).logits(policy, sequences)[0]
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_packed_response_logits_with_segment_attention_equal_padded(rollout_and_models):
    result, policy, _ = rollout_and_models
    segment = copy.deepcopy(policy)
    assert use_segment_attention(segment)
    sequences = result.training_tensors()
    mask = sequences["response_mask"].bool()
    with torch.no_grad():
        padded = PlainForward(1.0, 40).logits(policy, sequences)[0]
        packed = PackedForward(1.0, 40).logits(segment, sequences)[0]
        generated_path = PlainForward(1.0, 40).logits(segment, sequences)[0]  # padded: transformers' sdpa mask
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
            Prompts(prompts, chats, [{}, {}]),
            settings,
            seed=5,
            scoring=behaviour_scoring(settings, tokenizer, 2, variant=PackedForward if packed else PlainForward),
        )
        for packed in (False, True)
    ]
    assert torch.equal(rollouts[0].response_ids, rollouts[1].response_ids)
    assert torch.equal(rollouts[0].response_ids, result.response_ids)
    torch.testing.assert_close(rollouts[1].behaviour_logprobs, rollouts[0].behaviour_logprobs, atol=1e-5, rtol=0)


def minibatch_update(strategy, compute, model, micro_batches: list[dict]) -> tuple[float, dict, dict, int]:
    """One optimizer step's micro-batches as the loop runs them (one rank, DeepSpeed's division by A done by
    hand): (the step's loss, its metric sums, its gradients, the loss units the normaliser counted)."""
    weight = sum(strategy.loss_weight(batch) for batch in micro_batches)
    accumulation = strategy.job.train.grad_accum_steps
    normalizer = max(weight, 1.0) / accumulation
    model.zero_grad()
    loss, sums = 0.0, {}
    for batch in micro_batches:
        output = compute(PlainEngine(model), batch, normalizer)
        (output.loss / accumulation).backward()
        loss += float(output.loss.detach()) / accumulation
        for key, value in output.sums.items():
            sums[key] = sums.get(key, 0.0) + value
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss, sums, gradients, weight


def first_minibatch(strategy, pinned) -> list[dict]:
    return next(iter(strategy.minibatches(pinned, step=1, epoch=0)))


def sequence_tokens(result) -> list[int]:
    return result.training_tensors()["attention_mask"].sum(dim=1).tolist()


def assert_same_update(padded, packed) -> None:
    (loss_a, sums_a, grads_a, weight_a), (loss_b, sums_b, grads_b, weight_b) = padded, packed
    assert weight_a == weight_b > 0  # the global normaliser counts the same tokens
    assert loss_b == pytest.approx(loss_a, abs=1e-5) and loss_a != 0
    assert sums_a.keys() == sums_b.keys()
    for key, value in sums_a.items():
        assert sums_b[key] == pytest.approx(value, abs=1e-4), key
    assert_same_gradients(grads_a, grads_b)


# budget None: rl.packing's default budget (every minibatch in one micro-batch); "one": one sequence per
# micro-batch; "pad": one micro-batch more than the cut needs, as a rank with fewer tokens runs (empty, weight 0).
@pytest.mark.parametrize("budget", [None, "one", "pad"])
def test_grpo_packed_targets_loss_and_gradients_equal_padded(tokenizer, rollout_and_models, budget):
    result, policy, reference = rollout_and_models
    tokens = sequence_tokens(result)
    updates, targets, cuts = [], [], []
    for packing in (False, True):
        train = {"micro_batch_tokens": max(tokens)} if packing and budget == "one" else {}
        config = online_job("grpo", TINY, rl={"kl_coef": 0.1, "packing": packing, "epochs_per_rollout": 2}, train=train)
        strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
        if budget == "pad":
            strategy.agree_counts = lambda counts: [count + 1 for count in counts]
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        micro_batches = first_minibatch(strategy, pinned)
        cuts.append([int(batch["response_mask"].sum()) for batch in micro_batches])
        updates.append(minibatch_update(strategy, strategy.compute_loss, policy, micro_batches))
    assert_same_targets(*targets)
    assert_same_update(*updates)
    padded_cut, packed_cut = cuts
    assert len(padded_cut) == 2  # micro_batch_size 2 x grad_accum_steps 2
    assert len(packed_cut) == {None: 1, "one": 4, "pad": 2}[budget]
    if budget == "pad":
        assert packed_cut[-1] == 0  # the agreed extra micro-batch holds no loss token


def test_token_cut_keeps_every_sequence_whole_within_the_budget(tokenizer, rollout_and_models):
    result, _, reference = rollout_and_models
    tokens = sequence_tokens(result)
    budget = max(tokens) + min(tokens)
    config = online_job("grpo", TINY, rl={"packing": True}, train={"micro_batch_tokens": budget})
    strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
    pinned = strategy.frozen_targets(copy.copy(result))
    seen = []
    for micro_batches in strategy.minibatches(pinned, step=1, epoch=0):
        for batch in micro_batches:
            assert int(batch["attention_mask"].sum()) <= budget
            seen.extend(batch["input_ids"].tolist())
    assert sorted(seen) == sorted(pinned["input_ids"].tolist())  # each sequence once, whole
    assert strategy.forward_batches(pinned) == token_micro_batches(tokens, budget)


def test_sequence_over_the_token_budget_is_refused_naming_the_key(tokenizer, rollout_and_models):
    result, _, reference = rollout_and_models
    tokens = sequence_tokens(result)
    config = online_job("grpo", TINY, rl={"packing": True}, train={"micro_batch_tokens": max(tokens) - 1})
    strategy = setup(GrpoStrategy(config, tokenizer), config, reference)
    with pytest.raises(PackingError, match="train.micro_batch_tokens"):
        strategy.forward_batches(result.training_tensors())
    job = online_job("grpo", TINY, rl={"packing": True}, data={"max_seq_len": 64}, train={"micro_batch_tokens": 64})
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens 64: raise train.micro_batch_tokens to at least"):
        GrpoStrategy.check_job(job, 1)


@pytest.mark.parametrize("segment", [False, True])
@pytest.mark.parametrize("budget", [None, "one"])
def test_online_ppo_packed_policy_reference_and_critic_equal_padded(tokenizer, rollout_and_models, segment, budget):
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
    updates, targets = [], []
    for packing in (False, True):
        train = {"micro_batch_tokens": max(sequence_tokens(result))} if packing and budget == "one" else {}
        config = online_job("online_ppo", TINY, rl={"kl_coef": 0.1, "packing": packing}, train=train)
        strategy = ppo_setup(config, tokenizer, reference, critic)
        pinned = strategy.frozen_targets(copy.copy(result))
        targets.append(pinned)
        updates.append(ppo_updates(strategy, pinned, policy, critic))
    assert_same_targets(*targets)
    for padded, packed in zip(*updates):
        assert_same_update(padded, packed)
