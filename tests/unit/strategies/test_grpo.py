"""`grpo` pieces without DeepSpeed: batch geometry, frozen targets, minibatches, the loss by hand, and the
gradient invariance the online loop's normalizer promises (1 micro-batch == 2 micro-batches averaged)."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from astrai.algos.advantages import grpo_advantages
from astrai.config import ConfigError
from astrai.config.schema import JobConfig
from astrai.engine import DistInfo
from astrai.rollout.generation import generate_rollout
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.rollout.scoring import PlainForward, batches_of
from astrai.strategies.grpo import GrpoStrategy
from astrai.strategies.online_base import batch_geometry
from tests.unit.rollout_fixtures import LengthReward, PlainEngine, behaviour_scoring, tiny_model, tiny_tokenizer


def job(**sections) -> JobConfig:
    raw = {
        "output_dir": "/tmp/unused",
        "model": {"init": {"model_type": "llama"}},
        "tokenizer": {"build": {"kind": "char"}},
        "data": {"path": "unused.jsonl"},
        "train": {"train_type": "grpo", "max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5},
        "reward": {"function": "astrai.rollout.rewards:arithmetic_exact_match"},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return JobConfig.model_validate(raw)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def strategy_with(config: JobConfig, tokenizer, policy, reference=None, world=1):
    """A GrpoStrategy set up by hand: what `setup` would build, minus DeepSpeed."""
    strategy = GrpoStrategy(config, tokenizer)
    strategy.geometry = batch_geometry(config, world)
    strategy.dist = DistInfo(0, world, 0, torch.device("cpu"), "gloo")
    strategy.reward = WeightedReward([(LengthReward(), 1.0)])
    strategy.reference = PlainEngine(reference) if reference is not None else None
    return strategy


@pytest.fixture(scope="module")
def rollout_and_models(tokenizer):
    policy = tiny_model(tokenizer, seed=0)
    reference = tiny_model(tokenizer, seed=1)  # differs from the policy, so KL and its gradient are not 0
    config = job()
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    result = generate_rollout(
        PlainEngine(policy),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        config.rollout,
        seed=3,
        scoring=behaviour_scoring(config.rollout, tokenizer, 2),
    )
    return result, policy, reference


# ----------------------------------------------------------------------------- geometry


def test_batch_geometry_splits_a_rollout_into_optimizer_steps():
    geometry = batch_geometry(job(rollout={"prompts_per_step": 8, "group_size": 4}), world_size=2)
    assert (
        geometry.prompts_per_rank,
        geometry.sequences_per_rank,
        geometry.sequences_per_update,
        geometry.updates_per_epoch,
    ) == (4, 16, 4, 4)
    assert batch_geometry(job(rl={"minibatch_size": 8}), world_size=2).updates_per_epoch == 2
    assert GrpoStrategy(job(rl={"epochs_per_rollout": 3}), None).optimizer_steps_per_step(2) == 3 * 2


@pytest.mark.parametrize(
    ("changes", "world", "message"),
    [
        ({"rollout": {"prompts_per_step": 3}}, 2, "does not split over 2 ranks"),
        ({"rl": {"minibatch_size": 16}}, 2, r"= 8: .* set train.grad_accum_steps to 4 or leave rl.minibatch_size null"),
        ({"rollout": {"prompts_per_step": 2, "group_size": 3}}, 2, "3 responses, not a multiple of one minibatch's 4"),
    ],
)
def test_batch_geometry_errors_say_what_to_change(changes, world, message):
    with pytest.raises(ConfigError, match=message):
        batch_geometry(job(**changes), world)


def test_online_jobs_need_a_reward_steps_and_groups():
    with pytest.raises(ValidationError, match="needs a `reward` section"):
        JobConfig.model_validate({**job().model_dump(), "reward": None})
    with pytest.raises(ValidationError, match="give `train.max_steps`"):
        job(train={"max_steps": None, "epochs": 1.0})
    with pytest.raises(ValidationError, match="group_size` must be >= 2"):
        job(rollout={"group_size": 1})


# ----------------------------------------------------------------------------- targets and minibatches


def test_frozen_targets(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    result = copy.copy(result)
    strategy = strategy_with(job(), tokenizer, policy, reference)
    targets = strategy.frozen_targets(result)
    lengths = torch.tensor([float(len(text)) for text in result.response_texts])
    assert torch.equal(result.rewards, lengths)
    assert torch.allclose(targets["advantages"], grpo_advantages(lengths, 4))
    expected = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(reference, targets)
    assert torch.allclose(targets["reference_logprobs"], expected, atol=1e-6)
    assert set(targets) >= {
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_ids",
        "response_mask",
        "behaviour_logprobs",
    }
    mean_only = strategy_with(job(rl={"normalize_advantage_std": False}), tokenizer, policy).frozen_targets(
        copy.copy(result)
    )
    assert torch.allclose(mean_only["advantages"], lengths - lengths.reshape(2, 4).mean(1).repeat_interleave(4))
    assert "reference_logprobs" not in mean_only  # kl_coef 0 is "no reference": see setup


def test_minibatches_cover_each_sequence_once_per_epoch(tokenizer):
    strategy = strategy_with(job(rollout={"prompts_per_step": 2}), tokenizer, None)  # 2 prompts x 4 = 8 sequences
    targets = {"input_ids": torch.arange(8)[:, None], "value": torch.arange(8)}
    epochs = []
    for epoch in range(2):
        updates = list(strategy.minibatches(targets, step=5, epoch=epoch))
        assert len(updates) == 2 and all(
            len(micro_batches) == 2 for micro_batches in updates
        )  # 2 updates x accumulation 2
        order = [int(v) for micro_batches in updates for batch in micro_batches for v in batch["value"]]
        assert sorted(order) == list(range(8))
        epochs.append(order)
    assert epochs[0] != epochs[1]
    again = [int(v) for mb in strategy.minibatches(targets, step=5, epoch=0) for batch in mb for v in batch["value"]]
    assert again == epochs[0]  # seeded by (seed, step, epoch, rank): a resumed run replays the same order


# ----------------------------------------------------------------------------- the loss


def test_first_update_loss_by_hand(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    strategy = strategy_with(job(), tokenizer, policy, reference=policy)  # reference == policy: k3 is 0
    targets = strategy.frozen_targets(copy.copy(result))
    mask = targets["response_mask"].float()
    tokens = mask.sum()
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=float(tokens))
    # ratio == 1 at the behaviour weights, so loss = -sum_t A_t / T (token mean), no clipping, KL 0.
    expected = -(targets["advantages"][:, None] * mask).sum() / tokens
    assert output.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert output.sums["clip_frac"] == 0.0 and output.sums["kl"] == pytest.approx(0.0, abs=1e-6)
    assert (
        strategy.loss_weight(targets) == tokens.item() and output.sums["entropy"] > 0
    )  # the loop sums tokens and weight
    per_sequence = strategy_with(job(rl={"loss_aggregation": "sequence_mean"}), tokenizer, policy, reference=policy)
    output = per_sequence.compute_loss(PlainEngine(policy), targets, normalizer=8.0)
    expected = (-(targets["advantages"][:, None] * mask).sum(1) / mask.sum(1)).mean()
    assert output.loss.item() == pytest.approx(expected.item(), abs=1e-6) and per_sequence.loss_weight(targets) == 8


def test_one_update_per_rollout_skips_the_behaviour_forward(tokenizer, rollout_and_models):
    """16 sequences = one update of 8 x 2: the loss forward runs on the sampling weights, so pi_old = pi.detach()
    gives the loss and gradient of recomputed behaviour log-probs (to their ~1e-6 recompute noise)."""
    result, policy, reference = rollout_and_models
    one_update = job(train={"micro_batch_size": 8, "grad_accum_steps": 2}, rl={"kl_coef": 0.5})
    assert strategy_with(job(), tokenizer, policy).needs_behaviour_logprobs()  # 4 updates: the later ones need pi_old
    assert strategy_with(
        job(rl={"epochs_per_rollout": 2}, train={"micro_batch_size": 8, "grad_accum_steps": 2}), tokenizer, policy
    ).needs_behaviour_logprobs()
    strategy = strategy_with(one_update, tokenizer, policy, reference)
    assert not strategy.needs_behaviour_logprobs()
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    skipped = generate_rollout(
        PlainEngine(policy), tokenizer, Prompts(prompts, chats, [{}, {}]), one_update.rollout, seed=3
    )
    assert skipped.behaviour_logprobs is None and torch.equal(
        skipped.response_ids, result.response_ids
    )  # same seed, same samples
    without, recomputed = strategy.frozen_targets(skipped), strategy.frozen_targets(copy.copy(result))
    assert "behaviour_logprobs" not in without and "behaviour_logprobs" in recomputed

    def loss_and_gradient(targets):
        model = copy.deepcopy(policy)
        output = strategy.compute_loss(PlainEngine(model), targets, normalizer=float(targets["response_mask"].sum()))
        output.loss.backward()
        return output, torch.cat([p.grad.flatten() for p in model.parameters()])

    (fast, fast_gradient), (slow, slow_gradient) = loss_and_gradient(without), loss_and_gradient(recomputed)
    assert fast.loss.item() == pytest.approx(slow.loss.item(), abs=1e-6) and fast.sums["clip_frac"] == 0.0
    assert fast_gradient.abs().sum() > 0 and torch.allclose(fast_gradient, slow_gradient, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_split_micro_batches_give_the_whole_batch_gradient(tokenizer, rollout_and_models, aggregation):
    """What the online loop does: divide each micro-batch by global units / accumulation; DeepSpeed then
    averages the accumulated gradients. One micro-batch of 8 and two of 4 must give the same update."""
    result, policy, reference = rollout_and_models
    config = job(rl={"loss_aggregation": aggregation, "kl_coef": 0.5})
    strategy = strategy_with(config, tokenizer, policy, reference)
    targets = strategy.frozen_targets(copy.copy(result))
    targets["behaviour_logprobs"] = (
        targets["behaviour_logprobs"] - 0.3 * targets["response_mask"]
    )  # ratios != 1: clipping active
    model = copy.deepcopy(policy)

    def gradient(batches, accumulation):
        model.zero_grad()
        units = sum(strategy.loss_weight(batch) for batch in batches)
        for batch in batches:
            (strategy.compute_loss(PlainEngine(model), batch, units / accumulation).loss / accumulation).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()

    whole = gradient([targets], 1)
    halves = gradient([{k: v[:4] for k, v in targets.items()}, {k: v[4:] for k, v in targets.items()}], 2)
    assert whole.abs().sum() > 0
    assert torch.allclose(whole, halves, rtol=1e-4, atol=1e-7)


def test_batch_split_is_checked_before_any_rank_starts(monkeypatch):
    """astrai/train.py's pre-rank check reads the launcher's WORLD_SIZE, so a rollout that cannot split
    over the ranks fails with a ConfigError (exit 2) naming the job file, before the rendezvous."""
    from astrai.launch.job_checks import load_and_check

    tiny = [
        "model.path=null",
        "model.init={model_type: llama}",
        "tokenizer.build={kind: char}",
    ]  # runs/quickstart/hf may not exist
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert load_and_check("configs/quickstart_grpo.yaml", tiny).rollout.prompts_per_step == 16
    monkeypatch.setenv("WORLD_SIZE", "2")  # 8 prompts x 8 responses per rank: half a minibatch of 16 x 8
    with pytest.raises(
        ConfigError, match=r"quickstart_grpo\.yaml: each rank samples 8 prompts x rollout\.group_size 8 = 64 responses"
    ):
        load_and_check("configs/quickstart_grpo.yaml", tiny)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step 16 does not split over 3 ranks"):
        load_and_check("configs/quickstart_grpo.yaml", tiny)
