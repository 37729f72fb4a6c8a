"""RL options of issue #23 through the config and the real strategies (tiny transformers models, no
DeepSpeed): where the KL goes and which estimator it defaults to, the combinations refused before any
rank starts, the critic-free estimators' targets against loops, sequence_mean with empty rows against
verl's seq-mean-token-mean, and the accumulation invariance of every option (2 ranks x 2 micro-batches
= the same batch in one piece)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from pydantic import ValidationError

from astrai.algos.advantages import FixedKLController, rloo_advantages
from astrai.algos.kl import kl_estimate
from astrai.config import ConfigError
from astrai.config.schema import JobConfig
from astrai.engine import DistInfo
from astrai.models.value import ValueModel, trunk_of
from astrai.rollout.generation import generate_rollout
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.rewards import WeightedReward
from astrai.rollout.scoring import PlainForward, batches_of, masked_token_logprobs
from astrai.strategies.grpo import GrpoStrategy
from astrai.strategies.online_base import batch_geometry
from astrai.strategies.ppo import PPOStrategy
from tests.unit.rollout_fixtures import (
    LengthReward,
    PlainEngine,
    behaviour_scoring,
    online_job,
    tiny_model,
    tiny_tokenizer,
)

CPU = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")


def job(train_type: str = "grpo", **sections) -> JobConfig:
    return online_job(train_type, {"model_type": "llama"}, **sections)


def strategy_with(config: JobConfig, tokenizer, policy, reference=None):
    """The online strategy of `config`, set up by hand as `setup` would, minus DeepSpeed (one rank)."""
    strategy_class = GrpoStrategy if config.train.train_type == "grpo" else PPOStrategy
    strategy = strategy_class(config, tokenizer)
    strategy.geometry, strategy.dist = batch_geometry(config, 1), CPU
    strategy.reward = WeightedReward([(LengthReward(), 1.0)])
    strategy.reference = PlainEngine(reference) if reference is not None else None
    if strategy_class is PPOStrategy:
        strategy.critic = PlainEngine(ValueModel(trunk_of(copy.deepcopy(policy))))
        strategy.kl_controller = FixedKLController(config.rl.kl_coef)
        strategy.loss_kl_coef = config.rl.kl_coef
    return strategy


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rollout_and_models(tokenizer):
    policy, reference = tiny_model(tokenizer, seed=0), tiny_model(tokenizer, seed=1)
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    settings = job().rollout
    result = generate_rollout(
        PlainEngine(policy),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        settings,
        seed=3,
        scoring=behaviour_scoring(settings, tokenizer, 2),
    )
    return result, policy, reference


# ----------------------------------------------------------------------------- where the KL goes (item 1)


def test_the_kl_estimator_defaults_by_placement():
    assert job("online_ppo").rl.kl_kind("online_ppo") == "k1"  # in the reward: exact score-function gradient
    assert job("online_ppo", rl={"kl_in_reward": False}).rl.kl_kind("online_ppo") == "k3"  # a loss term
    assert job().rl.kl_kind("grpo") == "k3"
    assert job(rl={"advantage_estimator": "reinforce_pp"}).rl.kl_kind("grpo") == "k1"
    assert job(rl={"kl_estimator": "k2"}).rl.kl_kind("grpo") == "k2"
    assert job("online_ppo", rl={"kl_estimator": "k3"}).rl.kl_kind("online_ppo") == "k3"  # asked for: kept


@pytest.mark.parametrize(
    "train_type, rl, rollout, message",
    [
        (
            "grpo",
            {"kl_estimator": "k1"},
            {},
            r"`rl\.kl_estimator: k1` as a loss term \(`rl\.advantage_estimator: grpo`\) has zero expected gradient",
        ),
        (
            "grpo",
            {"kl_estimator": "k1", "advantage_estimator": "rloo"},
            {},
            r"k1` as a loss term \(`rl\.advantage_estimator: rloo`\)",
        ),
        (
            "online_ppo",
            {"kl_estimator": "k1", "kl_in_reward": False},
            {},
            r"k1` as a loss term \(`rl\.kl_in_reward: false`\)",
        ),
        (
            "online_ppo",
            {"advantage_estimator": "rloo"},
            {},
            r"`rl\.advantage_estimator: rloo` is for `train\.train_type: grpo`",
        ),
        (
            "grpo",
            {"advantage_estimator": "rloo"},
            {"group_size": 1},
            r"`rollout\.group_size` must be >= 2 with `rl\.advantage_estimator: rloo`",
        ),
        (
            "grpo",
            {"advantage_estimator": "reinforce_pp_baseline"},
            {"group_size": 1},
            r"group_size` must be >= 2 with `rl\.advantage_estimator: reinforce_pp_baseline",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_keys(train_type, rl, rollout, message):
    with pytest.raises(ValidationError, match=message):
        job(train_type, rl=rl, rollout=rollout)


def test_combinations_that_work_are_accepted():
    job(rl={"advantage_estimator": "reinforce_pp"}, rollout={"group_size": 1, "prompts_per_step": 8})  # no baseline
    job(rl={"kl_estimator": "k1", "kl_coef": 0.0})  # no KL at all: nothing to refuse
    job(rl={"kl_estimator": "k2"})  # k2 as a loss term is exactly grad KL(pi || ref)
    job("online_ppo", rl={"importance_sampling": "sequence", "dual_clip_c": 3.0})
    job(rl={"importance_sampling": "sequence", "loss_aggregation": "sequence_mean"})


def test_a_resolved_job_validates_again():
    """A checkpoint's job.yaml holds every key, defaults included: it must load again (export, resume)."""
    for train_type, rl in (
        ("grpo", {"advantage_estimator": "rloo"}),
        ("grpo", {"advantage_estimator": "reinforce_pp"}),
        ("online_ppo", {"kl_in_reward": False}),
        ("online_ppo", {"importance_sampling": "sequence"}),
    ):
        resolved = job(train_type, rl=rl).model_dump(mode="json")
        assert JobConfig.model_validate(resolved).rl == job(train_type, rl=rl).rl


def test_a_refused_combination_stops_the_job_before_any_rank(monkeypatch):
    from astrai.launch.job_checks import load_and_check

    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = ["model.path=null", "model.init={model_type: llama}", "tokenizer.build={kind: char}"]
    with pytest.raises(ConfigError, match=r"rl\.kl_estimator: k1` as a loss term"):
        load_and_check("configs/quickstart_grpo.yaml", [*tiny, "rl.kl_estimator=k1"])
    accepted = load_and_check("configs/quickstart_grpo.yaml", [*tiny, "rl.advantage_estimator=rloo"])
    assert accepted.rl.advantage_estimator == "rloo"


def test_online_ppo_shapes_the_reward_with_k1_by_default(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    config = job("online_ppo", rl={"kl_coef": 0.1, "whiten_advantages": False})
    strategy = strategy_with(config, tokenizer, policy, reference)
    targets = strategy.frozen_targets(result := copy.copy(result))
    mask = result.response_mask.bool()
    ref = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(reference, result.training_tensors())
    assert torch.allclose(targets.kl, torch.where(mask, result.behaviour_logprobs - ref, 0.0), atol=1e-6)
    assert (targets.kl[mask] < 0).any()  # k1 can be negative; k3 never is


# ----------------------------------------------------------------------------- critic-free estimators (item 8)


def test_rloo_targets(tokenizer, rollout_and_models):
    result, policy, _ = rollout_and_models
    strategy = strategy_with(job(rl={"advantage_estimator": "rloo", "kl_coef": 0.0}), tokenizer, policy)
    targets = strategy.frozen_targets(copy.copy(result))
    rewards = targets["rewards"] if "rewards" in targets else strategy_rewards(strategy, result)
    assert torch.allclose(targets["advantages"], rloo_advantages(rewards, 4))


def strategy_rewards(strategy, result) -> torch.Tensor:
    scored = copy.copy(result)
    strategy.score(scored)
    return scored.rewards


def whiten_loop(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the valid entries, written as plain loops."""
    entries = [values[row, t].item() for row in range(values.shape[0]) for t in range(values.shape[1]) if mask[row, t]]
    mean = sum(entries) / len(entries)
    variance = sum((x - mean) ** 2 for x in entries) / (len(entries) - 1)
    out = torch.zeros(values.shape, dtype=torch.float64)
    for row in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[row, t]:
                out[row, t] = (values[row, t].item() - mean) / (variance + 1e-8) ** 0.5
    return out


def test_reinforce_pp_baseline_targets_against_a_loop(tokenizer, rollout_and_models):
    """Group mean removed, broadcast to the response's tokens, whitened over every token of the step."""
    result, policy, _ = rollout_and_models
    config = job(rl={"advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.0})
    strategy = strategy_with(config, tokenizer, policy)
    targets = strategy.frozen_targets(copy.copy(result))
    rewards, mask = strategy_rewards(strategy, result).tolist(), targets["response_mask"]
    centred = torch.zeros(mask.shape, dtype=torch.float64)
    for row in range(8):
        group = rewards[row - row % 4 : row - row % 4 + 4]
        for t in range(mask.shape[1]):
            centred[row, t] = rewards[row] - sum(group) / 4
    assert targets["advantages"].shape == mask.shape
    assert torch.allclose(targets["advantages"].double(), whiten_loop(centred, mask), atol=1e-5)


def test_reinforce_pp_targets_against_a_loop(tokenizer, rollout_and_models):
    """Token rewards -kl_coef * k1 (+ the score on the last token), undiscounted returns, whitened over the
    step; no group baseline; the KL in the reward needs behaviour log-probs and is logged as `kl`."""
    result, policy, reference = rollout_and_models
    config = job(rl={"advantage_estimator": "reinforce_pp", "kl_coef": 0.1}, train={"micro_batch_size": 4})
    strategy = strategy_with(config, tokenizer, policy, reference)
    assert strategy.geometry.updates_per_epoch == 1 and strategy.needs_behaviour_logprobs()  # the reward reads them
    targets = strategy.frozen_targets(copy.copy(result))
    assert "reference_logprobs" not in targets  # no KL loss term
    rewards, mask = strategy_rewards(strategy, result).tolist(), targets["response_mask"]
    ref = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(reference, targets)
    k1 = (targets["behaviour_logprobs"] - ref).double()
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for row in range(8):
        length = int(mask[row].sum())
        for t in range(length):
            returns[row, t] = sum(-0.1 * k1[row, s].item() for s in range(t, length)) + rewards[row]
    assert torch.allclose(targets["advantages"].double(), whiten_loop(returns, mask), atol=1e-5)
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=float(mask.sum()))
    assert output.sums["kl"] == pytest.approx(float(k1[mask.bool()].sum()), abs=1e-4)


# ----------------------------------------------------------------------------- sequence_mean and empty rows (item 2)


def test_sequence_mean_with_empty_rows_matches_verl(tokenizer, rollout_and_models):
    """Two of eight responses without a token: the loss (and gradient) is the mean over the six others of
    their token means (verl's seq-mean-token-mean), and the loop's normaliser counts six responses."""
    result, policy, _ = rollout_and_models
    strategy = strategy_with(job(rl={"loss_aggregation": "sequence_mean", "kl_coef": 0.0}), tokenizer, policy)
    targets = strategy.frozen_targets(copy.copy(result))
    targets["response_mask"] = targets["response_mask"].clone()
    targets["response_mask"][[1, 6]] = 0
    targets["behaviour_logprobs"] = targets["behaviour_logprobs"] - 0.3 * targets["response_mask"]  # ratios != 1
    assert strategy.loss_weight(targets) == 6

    def gradient(loss_of):
        model = copy.deepcopy(policy)
        loss_of(model).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def verl_loss(model):
        mask = targets["response_mask"]
        logits = PlainForward().logits(PlainEngine(model), targets)[0]
        logprobs = masked_token_logprobs(logits, targets["response_ids"], mask)
        ratio = torch.exp(logprobs - targets["behaviour_logprobs"])
        advantages = targets["advantages"][:, None]
        losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
        rows = [row for row in range(8) if mask[row].sum() > 0]
        return sum((losses[row] * mask[row]).sum() / mask[row].sum() for row in rows) / len(rows)

    ours = gradient(lambda model: strategy.compute_loss(PlainEngine(model), targets, normalizer=6.0).loss)
    expected = gradient(verl_loss)
    assert torch.allclose(ours, expected, rtol=1e-4, atol=1e-7) and expected.abs().sum() > 0


# ----------------------------------------------------------------------------- accumulation invariance


AGGREGATIONS, SAMPLINGS = ["token_mean", "sequence_mean"], ["token", "sequence"]
ESTIMATORS = ["grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp"]
OPTIONS = [
    {"loss_aggregation": aggregation, "importance_sampling": sampling, "advantage_estimator": estimator}
    for aggregation, sampling, estimator in itertools.product(AGGREGATIONS, SAMPLINGS, ESTIMATORS)
]
PPO_OPTIONS = [
    {"loss_aggregation": aggregation, "importance_sampling": sampling, "kl_in_reward": in_reward, "entropy_coef": 0.01}
    for aggregation, sampling, in_reward in itertools.product(AGGREGATIONS, SAMPLINGS, [True, False])
]


def split_gradients(strategy, targets, model, critic=None) -> torch.Tensor:
    """The online loop's update over 2 simulated ranks x 2 micro-batches: every micro-batch divides by the
    step's units / (ranks x accumulation); DeepSpeed scales each backward by 1 / accumulation and
    averages over ranks. Returns the summed gradient (of the critic when given, else of the policy)."""
    engine_model = critic if critic is not None else model
    engine_model.zero_grad()
    splits = (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))  # rank 0: micro-batches 0, 1; rank 1: 2, 3
    pieces = [{key: value[rows] for key, value in targets.items()} for rows in splits]
    ranks, accumulation = 2, 2
    normalizer = sum(strategy.loss_weight(piece) for piece in pieces) / (ranks * accumulation)
    for piece in pieces:
        if critic is not None:
            loss = strategy.compute_critic_loss(PlainEngine(critic), piece, normalizer).loss
        else:
            loss = strategy.compute_loss(PlainEngine(model), piece, normalizer).loss
        (loss / accumulation / ranks).backward()
    return torch.cat([p.grad.flatten() for p in engine_model.parameters()]).clone()


def whole_gradient(strategy, targets, model, critic=None) -> torch.Tensor:
    engine_model = critic if critic is not None else model
    engine_model.zero_grad()
    if critic is not None:
        loss = strategy.compute_critic_loss(PlainEngine(critic), targets, float(strategy.loss_weight(targets))).loss
    else:
        loss = strategy.compute_loss(PlainEngine(model), targets, float(strategy.loss_weight(targets))).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in engine_model.parameters()]).clone()


def skewed(targets: dict) -> dict:
    """Ratios != 1 (so clipping and GSPO's sequence ratio act) and two responses without a token."""
    targets = dict(targets)
    mask = targets["response_mask"].clone()
    mask[[2, 5]] = 0
    generator = torch.Generator().manual_seed(7)
    targets["response_mask"] = mask
    shift = 0.4 * torch.rand(mask.shape, generator=generator) * mask
    targets["behaviour_logprobs"] = targets["behaviour_logprobs"] - shift
    return targets


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o.values()))
def test_grpo_two_ranks_by_two_micro_batches_equal_one_piece(tokenizer, rollout_and_models, options):
    result, policy, reference = rollout_and_models
    strategy = strategy_with(job(rl={**options, "kl_coef": 0.3}), tokenizer, policy, reference)
    targets = skewed(strategy.frozen_targets(copy.copy(result)))
    model = copy.deepcopy(policy)
    whole, split = whole_gradient(strategy, targets, model), split_gradients(strategy, targets, model)
    assert whole.abs().sum() > 0 and torch.allclose(whole, split, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("options", PPO_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_online_ppo_two_ranks_by_two_micro_batches_equal_one_piece(tokenizer, rollout_and_models, options):
    result, policy, reference = rollout_and_models
    strategy = strategy_with(job("online_ppo", rl={**options, "kl_coef": 0.3}), tokenizer, policy, reference)
    targets = skewed(strategy.frozen_targets(copy.copy(result)))
    targets["returns"] = targets["returns"] + 0.5  # a critic with something to learn
    model, critic = copy.deepcopy(policy), strategy.critic.module
    whole, split = whole_gradient(strategy, targets, model), split_gradients(strategy, targets, model)
    assert whole.abs().sum() > 0 and torch.allclose(whole, split, rtol=1e-4, atol=1e-7)
    whole, split = whole_gradient(strategy, targets, model, critic), split_gradients(strategy, targets, model, critic)
    assert whole.abs().sum() > 0 and torch.allclose(whole, split, rtol=1e-4, atol=1e-7)


def test_kl_loss_term_uses_the_configured_estimator(tokenizer, rollout_and_models):
    result, policy, reference = rollout_and_models
    strategy = strategy_with(job(rl={"kl_estimator": "k2", "kl_coef": 0.3}), tokenizer, policy, reference)
    targets = strategy.frozen_targets(copy.copy(result))
    mask = targets["response_mask"]
    output = strategy.compute_loss(PlainEngine(policy), targets, normalizer=float(mask.sum()))
    current = PlainForward(micro_batches=batches_of(8)).frozen_logprobs(policy, targets)
    k2 = kl_estimate(current, targets["reference_logprobs"], "k2", max_log_ratio=10.0)
    assert output.sums["kl"] == pytest.approx(float(k2[mask.bool()].sum()), rel=1e-4)
